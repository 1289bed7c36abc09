"""How ComfyUI's host side sees Mage-Flow: its MageFlow model class (supported_models.MageFlow, Flux.2's latent
format; ComfyUI 0.29.0 or newer, the templates' minimum), whose diffusion model takes one token per latent pixel."""
from __future__ import annotations

from ...contract import ComfyHost, HostHooks

COMFY = ComfyHost(model_classes={"": "MageFlow"},
                  unet_config=lambda info: {"image_model": "mage_flow", "in_channels": info.in_channels},
                  attributes=lambda info: {"patch_size": 1}, hooks=HostHooks(rope_options="ignored"))
