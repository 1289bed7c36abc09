"""How ComfyUI's host side sees Z-Image: its model classes (ZImage; MingImage), its patch and padding;
ScaleROPE's rope_options applied in the workers."""
from __future__ import annotations

from ...contract import ComfyHost, HostHooks
from .detection import PAD_MULTIPLE, PATCH


COMFY = ComfyHost(model_classes={"": "ZImage", "ming_image": "MingImage"},
                  unet_config=lambda info: {"in_channels": info.in_channels},
                  attributes=lambda info: {"patch_size": PATCH,
                                           "pad_tokens_multiple": info.config.get("pad_tokens_multiple", PAD_MULTIPLE)},
                  hooks=HostHooks(rope_options="applied"))
