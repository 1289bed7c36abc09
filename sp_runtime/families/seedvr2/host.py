"""How ComfyUI's host side sees SeedVR2: its SeedVR2 model class (supported_models.SeedVR2, a 16-channel 3-D latent;
the newest ComfyUI's), whose diffusion model takes x, timestep, context and the `condition` latent."""
from __future__ import annotations

from ...contract import ComfyHost, HostHooks

COMFY = ComfyHost(model_classes={"": "SeedVR2"}, unet_config=lambda info: {"image_model": "seedvr2"},
                  attributes=lambda info: {"patch_size": [1, 2, 2]}, hooks=HostHooks(rope_options="ignored"),
                  file_tensors=("positive_conditioning", "negative_conditioning"))  # SeedVR2Conditioning reads them
