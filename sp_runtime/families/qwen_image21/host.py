"""How ComfyUI's host side sees Qwen-Image 2.1: one model class, latents unpatched."""
from __future__ import annotations

from ...contract import ComfyHost, latent_channels


COMFY = ComfyHost(model_classes={"": "QwenImage21"},
                  unet_config=lambda info: {"image_model": "qwen_image21", **latent_channels(info)},
                  attributes=lambda info: {"patch_size": 1})  # 2.1 takes latents unpatched
