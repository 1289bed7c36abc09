"""How ComfyUI's host side sees Flux.2: one model class, its unet_config and the unpatched latent."""
from __future__ import annotations

from ...contract import ComfyHost, HostHooks, ModelInfo
from .detection import PATCH


def _comfy_unet_config(info: ModelInfo) -> dict:
    return {"image_model": "flux2", "in_channels": info.in_channels, "out_channels": info.out_channels,
            "patch_size": PATCH}


COMFY = ComfyHost(model_classes={"": "Flux2"}, unet_config=_comfy_unet_config,
                  attributes=lambda info: {"patch_size": PATCH}, hooks=HostHooks(rope_options="applied"))
