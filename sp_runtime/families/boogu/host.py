"""How ComfyUI's host side sees Boogu-Image: its Boogu model class (supported_models.Boogu, an OmniGen2 derivative on
the Flux latent; ComfyUI 0.26.0 or newer, the templates' minimum), patch 2; rope_options are ignored, as ComfyUI's
model ignores them."""
from __future__ import annotations

from ...contract import ComfyHost, HostHooks

COMFY = ComfyHost(model_classes={"": "Boogu"},
                  unet_config=lambda info: {"image_model": "boogu", "in_channels": info.in_channels},
                  hooks=HostHooks(rope_options="ignored"))
