"""How ComfyUI's host side sees HiDream: ComfyUI's HiDream model class (Flux's latent format; E1's reference image
arrives as `image_cond`, InstructPixToPixConditioning's concat latent)."""
from __future__ import annotations

from ...contract import ComfyHost, ModelInfo


def _comfy_unet_config(info: ModelInfo) -> dict:
    return {"image_model": "hidream", "in_channels": info.in_channels, "out_channels": info.out_channels}


COMFY = ComfyHost(model_classes={"": "HiDream"}, unet_config=_comfy_unet_config)
