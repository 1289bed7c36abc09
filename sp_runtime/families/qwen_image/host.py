"""How ComfyUI's host side sees Qwen-Image: one model class, which counts packed 2x2 patch features."""
from __future__ import annotations

from ...contract import ComfyHost, HostHooks


COMFY = ComfyHost(model_classes={"": "QwenImage"},
                  unet_config=lambda info: {"in_channels": info.in_channels * 4},  # ComfyUI counts packed 2x2 patches
                  hooks=HostHooks(rope_options="ignored"))
