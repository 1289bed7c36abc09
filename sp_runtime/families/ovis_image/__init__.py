"""Ovis-Image (text to image): ComfyUI's Flux model with SwiGLU MLPs and a text norm (its yak_mlp / txt_norm) on
diffusers' OvisImageTransformer2DModel, its SwiGLU projections split into up / gate (loading.py). The plan is Flux.1's
with Ovis' text norm, ids, time embedding and single blocks (plan.py): the image split, the text replicated. The keys
are Flux.1's (keys.py). The reference is sp_lab.references.ovis_image."""
from ..family import Family, PlanModel
from ..flux import PATCH
from .detection import CLASS_NAME, CONFIG_KEYS, NAME, detect
from .host import COMFY
from .keys import original_plan, weight_plan
from .loading import build_model
from .plan import PLAN

MODEL = PlanModel(NAME, "Ovis-Image", CLASS_NAME, detect, weight_plan, PLAN, 4, CONFIG_KEYS, build=build_model,
                  channels=lambda model: (model.config.in_channels // (PATCH * PATCH),) * 2)
load, load_model = MODEL.load, MODEL.load_model

FAMILY = Family(NAME, "Ovis-Image", detect, load, COMFY, weight_plan, original_plan, load_model)

__all__ = ["COMFY", "CONFIG_KEYS", "FAMILY", "NAME", "PLAN", "detect", "load", "load_model", "original_plan",
           "weight_plan"]
