"""How ComfyUI's host side sees Z-Image: one model class (NextDiT with Z-Image's options), its patch and padding;
ScaleROPE's rope_options applied in the workers."""
from __future__ import annotations

from ...contract import ComfyHost, HostHooks, ModelInfo
from .detection import PAD_MULTIPLE, PATCH


def _comfy_unet_config(info: ModelInfo) -> dict:
    return {"in_channels": info.in_channels}


COMFY = ComfyHost(model_classes={"": "ZImage"}, unet_config=_comfy_unet_config,
                  attributes=lambda info: {"patch_size": PATCH, "pad_tokens_multiple": PAD_MULTIPLE},
                  hooks=HostHooks(rope_options="applied"))
