"""How ComfyUI's host side sees Lumina 2: its model class (supported_models.Lumina2, NextDiT without Z-Image's
options), its patch; ScaleROPE's rope_options applied in the workers."""
from __future__ import annotations

from ...contract import ComfyHost, HostHooks, ModelInfo
from .detection import PATCH


def _comfy_unet_config(info: ModelInfo) -> dict:
    return {"in_channels": info.in_channels}


COMFY = ComfyHost(model_classes={"": "Lumina2"}, unet_config=_comfy_unet_config,
                  attributes=lambda info: {"patch_size": PATCH, "pad_tokens_multiple": None},
                  hooks=HostHooks(rope_options="applied"))
