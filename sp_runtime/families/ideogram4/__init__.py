"""Ideogram 4: ComfyUI's `diffusion_model(x, timesteps, context, attention_mask)` (Ideogram4Transformer2DModel in
comfy/ldm/ideogram4: t = 1 - sigma, output negated; context None runs the image alone, as DualModelGuider's
text-free negative pass does) on diffusers' Ideogram4Transformer2DModel.

Plan (plan.py): one split stream [text | image] (the image in ComfyUI's 128-channel latent, one token per latent
pixel); every block attends over the whole stream; AdaLN per item; the interleaved MRoPE as sp.tokens'
PairFrequencies (float32 angles), its split-half pairs made adjacent by reordering q / k channels.
"""
from ..family import Family, PlanModel
from .detection import CLASS_NAME, CONFIG_KEYS, NAME, architecture, detect
from .host import COMFY
from .keys import original_plan, weight_plan
from .plan import PLAN

MODEL = PlanModel(NAME, "Ideogram 4", CLASS_NAME, detect, weight_plan, PLAN, 4, CONFIG_KEYS,
                  channels=lambda model: (model.config.in_channels, model.config.in_channels))
load, load_model = MODEL.load, MODEL.load_model

FAMILY = Family(NAME, "Ideogram 4", detect, load, COMFY, weight_plan, original_plan, load_model,
                signatures=("embed_image_indicator.weight",))

__all__ = ["FAMILY", "CONFIG_KEYS", "COMFY", "NAME", "PLAN", "architecture", "detect", "load", "load_model",
           "original_plan", "weight_plan"]
