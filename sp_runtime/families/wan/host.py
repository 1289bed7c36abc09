"""What ComfyUI's host side needs of a Wan: its model class per variant (the variants' own from the registry) and the
attributes ComfyUI's Wan classes read from diffusion_model."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from ...contract import ComfyHost, HostHooks, ModelInfo, patch_size_2
from .variants import REGISTRY

COMFY_PATCH = (1, 2, 2)
# t2v, and i2v_concat (Wan 2.2 A14B I2V: image latent in extra input channels), map to WAN21_T2V
MODEL_CLASSES = {"i2v": "WAN21_I2V", "flf2v": "WAN21_I2V", "ti2v": "WAN22_T2V", "": "WAN21_T2V"}


def _comfy_unet_config(info: ModelInfo) -> dict:
    return {"in_dim": info.in_channels, "out_dim": info.out_channels}


def _comfy_attributes(info: ModelInfo) -> dict:
    """ComfyUI's Wan classes read diffusion_model.patch_embedding.weight.shape (a plain object here, no weights)."""
    dim = int(info.config.get("dim", info.config.get("inner_dim", 0)) or 0)
    shape = torch.Size((dim, info.in_channels, *COMFY_PATCH))
    return {**patch_size_2(info), "patch_embedding": SimpleNamespace(weight=SimpleNamespace(shape=shape))}


def comfy_host() -> ComfyHost:
    """The host description with every registered variant's classes (build it after they registered)."""
    classes = {name: cls for variant in REGISTRY for name, cls in variant.comfy.items()}
    return ComfyHost(model_classes={**classes, **MODEL_CLASSES}, unet_config=_comfy_unet_config,
                     attributes=_comfy_attributes,
                     metadata_variants=tuple(v.model_type for v in REGISTRY if v.model_type),
                     hooks=HostHooks(rope_options="applied"))
