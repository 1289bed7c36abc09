"""LongCat-Image (text to image, Edit): ComfyUI's LongCatImage (its Flux model with text ids on the row / column axes
and the image shifted past the text) on diffusers' LongCatImageTransformer2DModel. The plan is Flux.1's with LongCat's
ids and time embedding (plan.py); the keys are Flux.1's (keys.py). The reference is sp_lab.references.longcat_image."""
from ..family import Family, PlanModel
from ..flux import PATCH
from .detection import CLASS_NAME, CONFIG_KEYS, NAME, detect
from .host import COMFY
from .keys import original_plan, weight_plan
from .plan import PLAN

MODEL = PlanModel(NAME, "LongCat-Image", CLASS_NAME, detect, weight_plan, PLAN, 4, CONFIG_KEYS,
                  channels=lambda model: (model.config.in_channels // (PATCH * PATCH),) * 2)
load, load_model = MODEL.load, MODEL.load_model

FAMILY = Family(NAME, "LongCat-Image (and Edit)", detect, load, COMFY, weight_plan, original_plan, load_model)

__all__ = ["COMFY", "CONFIG_KEYS", "FAMILY", "NAME", "PLAN", "detect", "load", "load_model", "original_plan",
           "weight_plan"]
