"""How ComfyUI's host side sees JoyAI-Image-Edit: its JoyImage model class (supported_models.JoyImage, Wan 2.1's
latent format, reference latents from TextEncodeJoyImageEdit; ComfyUI 0.33.0 has it), which ignores rope_options."""
from __future__ import annotations

from ...contract import ComfyHost, HostHooks

COMFY = ComfyHost(model_classes={"": "JoyImage"},
                  unet_config=lambda info: {"image_model": "joyimage", "in_channels": info.in_channels},
                  attributes=lambda info: {"patch_size": list(info.config.get("patch_size", (1, 2, 2)))},
                  hooks=HostHooks(rope_options="ignored"))
