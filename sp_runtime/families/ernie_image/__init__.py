"""ERNIE-Image (and Turbo; text to image): ComfyUI's ErnieImage `diffusion_model(x, timesteps, context)` on diffusers'
ErnieImageTransformer2DModel. ComfyUI names the weights as diffusers does (the key plan is the identity);
detection.py reads the header, plan.py is the sequence-parallel plan (one split stream [image | text], every block
over all of it, ERNIE's own split-half rotary applied by the plan), host.py ComfyUI's class. The reference is
sp_lab.references.ernie_image."""
from ...checkpoints.loading import diffusers_names as weight_plan, identity_plan as original_plan
from ..family import Family, PlanModel
from .detection import CLASS_NAME, CONFIG_KEYS, DESCRIPTION, NAME, detect
from .host import COMFY
from .plan import PLAN

MODEL = PlanModel(NAME, "ERNIE-Image", CLASS_NAME, detect, weight_plan, PLAN, 4, CONFIG_KEYS)
load, load_model = MODEL.load, MODEL.load_model

FAMILY = Family(NAME, DESCRIPTION, detect, load, COMFY, weight_plan, original_plan, load_model,
                signatures=("layers.0.mlp.linear_fc2.weight",))

__all__ = ["COMFY", "CONFIG_KEYS", "DESCRIPTION", "FAMILY", "NAME", "PLAN", "detect", "load", "load_model",
           "original_plan", "weight_plan"]
