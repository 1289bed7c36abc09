"""How ComfyUI's host side sees SD3 / SD3.5: ComfyUI's SD3 model class (SD3.5 included; MMDiT with patch 2)."""
from __future__ import annotations

from ...contract import ComfyHost, ModelInfo


def _comfy_unet_config(info: ModelInfo) -> dict:
    return {"in_channels": info.in_channels, "out_channels": info.out_channels}


COMFY = ComfyHost(model_classes={"": "SD3"}, unet_config=_comfy_unet_config)
