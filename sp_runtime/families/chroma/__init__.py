"""Chroma (HD and the v4x / v50 releases) under Ulysses SP: Flux.1's architecture without per-block modulation
(one distilled guidance network gives every block its shift / scale / gate vectors), T5 text only, on diffusers'
ChromaTransformer2DModel; ComfyUI's `diffusion_model(x, timestep, context, guidance, attention_mask)` (ComfyUI's
Chroma model class). Chroma Radiance (pixel space, a per-patch NeRF decoder head) is refused by name.

detection.py reads the header, keys.py is Flux.1's key plan plus the guidance network's names, plan.py is flux.PLAN
with Chroma's differences (modulation per block from the approximator, single blocks fed the joined sequence, a text
padding mask).
"""
from ..family import Family, PlanModel
from .detection import CLASS_NAME, CONFIG_KEYS, DESCRIPTION, NAME, detect
from .host import COMFY
from .keys import original_plan, weight_plan
from .plan import PATCH, PLAN

MODEL = PlanModel(NAME, "Chroma", CLASS_NAME, detect, weight_plan, PLAN, 4, CONFIG_KEYS, channels=lambda model: (
    model.config.in_channels // (PATCH * PATCH), model.proj_out.out_features // (PATCH * PATCH)))
load, load_model = MODEL.load, MODEL.load_model

FAMILY = Family(NAME, DESCRIPTION, detect, load, COMFY, weight_plan, original_plan, load_model,
                signatures=("distilled_guidance_layer.in_proj.weight",))

__all__ = ["COMFY", "DESCRIPTION", "FAMILY", "NAME", "PLAN", "detect", "load", "load_model", "original_plan",
           "weight_plan"]
