"""Mage-Flow (base, turbo, edit): ComfyUI's MageFlow `diffusion_model(x, timestep, context, attention_mask,
ref_latents)` (MageFlowTransformer2DModel: Qwen-Image's double-stream blocks at patch 1 on Flux.2's 128-channel
latent) on diffusers' QwenImageTransformer2DModel, whose keys ComfyUI's files use.

Plan (plan.py, Qwen-Image's with Mage's tokens and time): the latent's pixels and the edit's reference latents are
split over the ranks (rotary index 0 and 1 .. N), the text is replicated with its padding mask at position 0 and
joined in every block; the head writes each rank's own output tokens. The reference is sp_lab.references.mage_flow.
"""
from ...checkpoints.loading import diffusers_names as weight_plan, identity_plan as original_plan
from ..family import Family, PlanModel, with_rope_axes_option
from .detection import CLASS_NAME, CONFIG_KEYS, DESCRIPTION, NAME, VARIANT, architecture, detect, is_mage_flow
from .host import COMFY
from .plan import PLAN, centred

MODEL = PlanModel(NAME, "Mage-Flow", CLASS_NAME, detect, weight_plan, PLAN, 4, CONFIG_KEYS,
                  prepare=with_rope_axes_option)
load, load_model, worker_from_model = MODEL.load, MODEL.load_model, MODEL.worker

FAMILY = Family(NAME, DESCRIPTION, detect, load, COMFY, weight_plan, original_plan, load_model)

__all__ = ["COMFY", "CONFIG_KEYS", "DESCRIPTION", "FAMILY", "MODEL", "NAME", "PLAN", "VARIANT", "architecture",
           "centred", "detect", "is_mage_flow", "load", "load_model", "original_plan", "weight_plan",
           "worker_from_model"]
