"""How ComfyUI's host side sees Anima: its model class (supported_models.Anima), and the preprocess_text_embeds its
extra_conds calls on diffusion_model, which here packs the adapter's inputs for the workers (text.pack)."""
from __future__ import annotations

from ...contract import ComfyHost, ModelInfo
from . import text


def _comfy_unet_config(info: ModelInfo) -> dict:
    config = info.config
    return {"image_model": "anima", "in_channels": info.in_channels,
            "model_channels": config["num_attention_heads"] * config["attention_head_dim"]}


def _comfy_attributes(info: ModelInfo) -> dict:
    return {"patch_size": 2, "preprocess_text_embeds": text.pack}


COMFY = ComfyHost(model_classes={"": "Anima"}, unet_config=_comfy_unet_config, attributes=_comfy_attributes)
