"""Flux.2 (dev, klein): ComfyUI's `diffusion_model(x, timestep, context, guidance, ref_latents)` (ComfyUI's Flux
class with Flux.2 params) on diffusers' Flux2Transformer2DModel.

Plan (plan.py): flux.PLAN with its differences, in code (dataclasses.replace): the image tokens (target, then
references) split over the ranks, the text replicated; 4-axis rotary with theta 2000 and the text on the fourth
axis; shared modulations; fused single blocks over [text, image].
"""
from ..family import Family, PlanModel
from .detection import CLASS_NAME, CONFIG_KEYS, NAME, PATCH, architecture, detect
from .host import COMFY
from .keys import original_plan, weight_plan
from .plan import DEFAULT_REF_METHOD, PLAN, placements, text_ids

MODEL = PlanModel(NAME, "Flux.2", CLASS_NAME, detect, weight_plan, PLAN, 4, CONFIG_KEYS,
                  channels=lambda model: (model.config.in_channels, model.out_channels))
load, load_model, worker_from_model = MODEL.load, MODEL.load_model, MODEL.worker

FAMILY = Family(NAME, "Flux.2 (dev, klein)", detect, load, COMFY, weight_plan, original_plan, load_model,
                gguf_architectures=("flux",),
                signatures=("double_stream_modulation_img.lin.weight", "single_stream_modulation.lin.weight"))

__all__ = ["FAMILY", "CONFIG_KEYS", "COMFY", "DEFAULT_REF_METHOD", "NAME", "PATCH", "PLAN", "architecture", "detect",
           "load", "load_model", "original_plan", "placements", "text_ids", "weight_plan", "worker_from_model"]
