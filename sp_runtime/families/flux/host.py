"""How ComfyUI's host side sees Flux.1: its model classes per variant and the unet_config entries they read."""
from __future__ import annotations

from ...contract import ComfyHost, HostHooks, ModelInfo


def _comfy_unet_config(info: ModelInfo) -> dict:
    return {"in_channels": info.in_channels, "out_channels": info.out_channels}  # latent channels, as ComfyUI's


COMFY = ComfyHost(model_classes={"schnell": "FluxSchnell", "fill": "FluxInpaint", "": "Flux"},
                  unet_config=_comfy_unet_config, hooks=HostHooks(rope_options="applied"))
