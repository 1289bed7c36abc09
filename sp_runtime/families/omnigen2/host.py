"""How ComfyUI's host side sees OmniGen2: its model class (supported_models.Omnigen2), the latent channels, the
patch; ScaleROPE's rope_options ignored, as ComfyUI's OmniGen2 ignores them."""
from __future__ import annotations

from ...contract import ComfyHost, HostHooks
from .detection import PATCH

COMFY = ComfyHost(model_classes={"": "Omnigen2"}, unet_config=lambda info: {"in_channels": info.in_channels},
                  attributes=lambda info: {"patch_size": PATCH}, hooks=HostHooks(rope_options="ignored"))
