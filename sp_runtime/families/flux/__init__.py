"""Flux.1 (dev, schnell, Kontext, Fill, Depth/Canny): ComfyUI's `diffusion_model(x, timestep, context, y, guidance,
ref_latents)` on diffusers' FluxTransformer2DModel.

Plan (plan.py): the output latent and its references are patchified and split over the ranks, the T5 text is
replicated; double blocks join the text through the added projections, single blocks take it as the first tokens;
the head writes each rank's own output tokens. Flux.2 reuses this PLAN with its differences.
"""
from ..family import Family, PlanModel, with_rope_axes_option
from .detection import CONFIG_KEYS, NAME, PATCH, REF_METHODS, architecture, detect, variant_of
from .host import COMFY
from .keys import flux_key_plan, original_plan, weight_plan
from .plan import PLAN, image_and_text, per_item

MODEL = PlanModel(NAME, "Flux.1", "FluxTransformer2DModel", detect, weight_plan, PLAN, 4, CONFIG_KEYS,
                  prepare=with_rope_axes_option, channels=lambda model: (
                      model.config.in_channels // (PATCH * PATCH), model.proj_out.out_features // (PATCH * PATCH)))
load, load_model, worker_from_model = MODEL.load, MODEL.load_model, MODEL.worker

FAMILY = Family(NAME, "Flux.1 (dev, schnell, Kontext, Fill, Depth/Canny)", detect, load, COMFY, weight_plan,
                original_plan, load_model, gguf_architectures=("flux",))

__all__ = ["FAMILY", "CONFIG_KEYS", "COMFY", "NAME", "PATCH", "PLAN", "REF_METHODS", "architecture", "detect",
           "flux_key_plan", "image_and_text", "load", "load_model", "MODEL", "original_plan", "per_item",
           "variant_of", "weight_plan", "worker_from_model"]
