"""Chroma (HD and the v4x / v50 releases) under Ulysses SP: Flux.1's architecture without per-block modulation
(one distilled guidance network gives every block its shift / scale / gate vectors), T5 text only, on diffusers'
ChromaTransformer2DModel; ComfyUI's `diffusion_model(x, timestep, context, guidance, attention_mask)` (ComfyUI's
Chroma model class). Chroma Radiance (pixel space, a per-patch NeRF decoder head) is refused by name.

detect.py reads the header, keys.py is Flux.1's key plan plus the guidance network's names, plan.py is flux.PLAN
with Chroma's differences (modulation per block from the approximator, single blocks fed the joined sequence, a text
padding mask).
"""
from ...contract import ComfyHost, ModelInfo
from .detect import DESCRIPTION, FAMILY, detect
from .keys import original_plan, weight_plan
from .plan import PLAN, load, load_model


def _comfy_unet_config(info: ModelInfo) -> dict:
    return {"image_model": "chroma", "in_channels": info.in_channels, "out_channels": info.out_channels}


COMFY = ComfyHost(model_classes={"": "Chroma"}, unet_config=_comfy_unet_config)

__all__ = ["COMFY", "DESCRIPTION", "FAMILY", "PLAN", "detect", "load", "load_model", "original_plan", "weight_plan"]
