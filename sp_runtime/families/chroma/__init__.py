"""Chroma (HD and the v4x / v50 releases) under Ulysses SP: Flux.1's architecture without per-block modulation
(one distilled guidance network gives every block its shift / scale / gate vectors), T5 text only, on diffusers'
ChromaTransformer2DModel; ComfyUI's `diffusion_model(x, timestep, context, guidance, attention_mask)` (ComfyUI's
Chroma model class). Chroma Radiance (pixel space, a per-patch NeRF decoder head) is refused by name.

detection.py reads the header, keys.py is Flux.1's key plan plus the guidance network's names, plan.py is flux.PLAN
with Chroma's differences (modulation per block from the approximator, single blocks fed the joined sequence, a text
padding mask).
"""
from ..family import Family
from .detection import DESCRIPTION, NAME, detect
from .host import COMFY
from .keys import original_plan, weight_plan
from .loading import load, load_model
from .plan import PLAN

FAMILY = Family(NAME, DESCRIPTION, detect, load, COMFY, weight_plan, original_plan, load_model,
                signatures=("distilled_guidance_layer.in_proj.weight",))

__all__ = ["COMFY", "DESCRIPTION", "FAMILY", "NAME", "PLAN", "detect", "load", "load_model", "original_plan",
           "weight_plan"]
