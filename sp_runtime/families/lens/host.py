"""How ComfyUI's host side sees Lens: its Lens model class (supported_models.Lens, model_base.Lens: Flux.2's latent
format, ModelType.FLUX, the text's attention_mask passed), whose diffusion model takes one token per latent pixel
and ignores rope_options."""
from __future__ import annotations

from ...contract import ComfyHost, HostHooks

COMFY = ComfyHost(model_classes={"": "Lens"},
                  unet_config=lambda info: {"image_model": "lens", "in_channels": info.in_channels},
                  hooks=HostHooks(rope_options="ignored"))
