"""Lumina 2 (Lumina-Image 2.0, NetaYume, NewBie): ComfyUI's `diffusion_model(x, timestep, context, num_tokens,
attention_mask)` (NextDiT in comfy/ldm/lumina without Z-Image's options: t = 1 - sigma, output negated) on diffusers'
Lumina2Transformer2DModel.

Plan (plan.py): the caption and the image tokens are two split streams; `context_refiner` and `noise_refiner`
attend within one stream, `layers` over both (each rank's caption shard, then its image shard). The grouped key /
value heads are repeated to the query heads; Ulysses pads heads to the degree. NewBie (variant "newbie") adds its
pooled CLIP text to the time embedding (newbie.py: two modules diffusers' class lacks); nothing else changes.
"""
from ..family import Family, PlanModel
from .detection import CLASS_NAME, CONFIG_KEYS, NAME, PATCH, UNUSED, architecture, detect
from .host import COMFY
from .keys import original_plan, weight_plan
from .newbie import build_model
from .plan import PLAN

MODEL = PlanModel(NAME, "Lumina 2", CLASS_NAME, detect, weight_plan, PLAN, 4, CONFIG_KEYS, ignore=UNUSED,
                  channels=lambda model: (model.config.in_channels, model.config.in_channels), build=build_model)
load, load_model = MODEL.load, MODEL.load_model

FAMILY = Family(NAME, "Lumina 2 (Lumina-Image 2.0, NetaYume, NewBie)", detect, load, COMFY, weight_plan,
                original_plan, load_model, signatures=("noise_refiner.0.adaLN_modulation.1.weight",))

__all__ = ["FAMILY", "CONFIG_KEYS", "COMFY", "NAME", "PATCH", "PLAN", "architecture", "detect", "load",
           "load_model", "original_plan", "weight_plan"]
