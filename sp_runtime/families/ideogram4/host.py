"""How ComfyUI's host side sees Ideogram 4: its model class (supported_models.Ideogram4, a FLOW model with
multiplier 1: the timestep is sigma) and its detection's unet_config."""
from __future__ import annotations

from ...contract import ComfyHost, ModelInfo


def _comfy_unet_config(info: ModelInfo) -> dict:
    return {"image_model": "ideogram4", "in_channels": info.in_channels, "num_layers": info.config["num_layers"]}


COMFY = ComfyHost(model_classes={"": "Ideogram4"}, unet_config=_comfy_unet_config)
