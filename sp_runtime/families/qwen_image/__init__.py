"""Qwen-Image / Qwen-Image-Edit (2509, 2511) and Qwen-Image-Layered: ComfyUI's `diffusion_model(x, timestep,
context, attention_mask, ref_latents, additional_t_cond)` on diffusers' QwenImageTransformer2DModel.

Plan (plan.py): the output latent's frames (Layered: the RGBA layers, at rotary index 0 .. T-1) and the reference
latents are patchified and split over the ranks; the text is replicated with its padding mask and joined in every
block; Edit-2511 modulates the reference tokens at timestep 0; the head writes each rank's own output tokens.
"""
from ...checkpoints.loading import diffusers_names as weight_plan, identity_plan as original_plan
from ..family import Family, PlanModel
from .detection import (CONFIG_KEYS, EDIT_2511_MARKER, LAYERED_MARKER, NAME, PATCH, REF_METHODS, VARIANT_EDIT_2511,
                        VARIANT_IMAGE, VARIANT_LAYERED, architecture, detect, with_options)
from .host import COMFY
from .plan import PLAN, as_4d, default_ref_method

MODEL = PlanModel(NAME, "Qwen-Image", "QwenImageTransformer2DModel", detect, weight_plan, PLAN, 5, CONFIG_KEYS,
                  prepare=with_options, ignore=(EDIT_2511_MARKER,),
                  channels=lambda model: (model.config.in_channels // (PATCH * PATCH), model.config.out_channels))
load, load_model, worker_from_model = MODEL.load, MODEL.load_model, MODEL.worker

FAMILY = Family(NAME, "Qwen-Image / Qwen-Image-Edit (2509, 2511)", detect, load, COMFY, weight_plan, original_plan,
                load_model, gguf_architectures=("qwen_image",))

__all__ = ["FAMILY", "CONFIG_KEYS", "COMFY", "EDIT_2511_MARKER", "LAYERED_MARKER", "NAME", "PATCH", "PLAN",
           "REF_METHODS", "VARIANT_EDIT_2511", "VARIANT_IMAGE", "VARIANT_LAYERED", "architecture", "as_4d",
           "default_ref_method", "detect", "load", "load_model", "MODEL", "original_plan", "weight_plan",
           "worker_from_model"]
