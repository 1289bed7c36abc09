"""How ComfyUI's host side sees Qwen-Image 2.1: one model class, latents unpatched."""
from __future__ import annotations

from ...contract import ComfyHost, ModelInfo


def _comfy_unet_config(info: ModelInfo) -> dict:
    return {"image_model": "qwen_image21", "in_channels": info.in_channels, "out_channels": info.out_channels}


COMFY = ComfyHost(model_classes={"": "QwenImage21"}, unet_config=_comfy_unet_config,
                  attributes=lambda info: {"patch_size": 1})  # 2.1 takes latents unpatched
