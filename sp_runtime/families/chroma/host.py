"""How ComfyUI's host side sees Chroma: ComfyUI's Chroma model class (Flux's latent format and 2x2 patches)."""
from __future__ import annotations

from ...contract import ComfyHost, ModelInfo


def _comfy_unet_config(info: ModelInfo) -> dict:
    return {"image_model": "chroma", "in_channels": info.in_channels, "out_channels": info.out_channels}


COMFY = ComfyHost(model_classes={"": "Chroma"}, unet_config=_comfy_unet_config)
