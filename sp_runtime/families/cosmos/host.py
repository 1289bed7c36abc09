"""How ComfyUI's host side sees Cosmos-Predict2: its model classes (supported_models.CosmosT2IPredict2 /
CosmosI2VPredict2) and the unet_config ComfyUI's detection derives."""
from __future__ import annotations

from ...contract import ComfyHost, ModelInfo


def _comfy_unet_config(info: ModelInfo) -> dict:
    config = info.config
    return {"image_model": "cosmos_predict2", "in_channels": info.in_channels,
            "model_channels": config["num_attention_heads"] * config["attention_head_dim"]}


COMFY = ComfyHost(model_classes={"t2i": "CosmosT2IPredict2", "v2w": "CosmosI2VPredict2"},
                  unet_config=_comfy_unet_config)
