"""How ComfyUI's host side sees HiDream: ComfyUI's HiDream model class (Flux's latent format; E1's reference image
arrives as `image_cond`, InstructPixToPixConditioning's concat latent)."""
from __future__ import annotations

from ...contract import ComfyHost, latent_channels


COMFY = ComfyHost(model_classes={"": "HiDream"},
                  unet_config=lambda info: {"image_model": "hidream", **latent_channels(info)})
