"""Lens (base, turbo): ComfyUI's Lens `diffusion_model(x, timestep, context, attention_mask)`
(LensTransformer2DModel: Qwen-Image's double-stream MMDiT with fused q / k / v, SwiGLU MLPs, RMS-normed blocks and a
multi-layer text norm, on Flux.2's 128-channel latent) on diffusers' QwenImageTransformer2DModel at patch 1 with
those modules rebuilt (loading.py) and the fused q / k / v split on load (keys.py).

Plan (plan.py, Qwen-Image's with Lens' tokens): the latent's pixels are split over the ranks, the text is replicated
with its padding mask and joined in every block; the head writes each rank's own output tokens. The reference is
sp_lab.references.lens (ComfyUI's math on ComfyUI's keys, no diffusers).
"""
from ..family import Family, PlanModel, with_rope_axes_option
from .detection import CLASS_NAME, CONFIG_KEYS, DESCRIPTION, NAME, VARIANT, architecture, detect
from .host import COMFY
from .keys import original_plan, weight_plan
from .loading import build_model
from .plan import PLAN

MODEL = PlanModel(NAME, "Lens", CLASS_NAME, detect, weight_plan, PLAN, 4, CONFIG_KEYS, prepare=with_rope_axes_option,
                  build=build_model)
load, load_model, worker_from_model = MODEL.load, MODEL.load_model, MODEL.worker

FAMILY = Family(NAME, DESCRIPTION, detect, load, COMFY, weight_plan, original_plan, load_model,
                signatures=("img_mlp.w1.weight",))

__all__ = ["COMFY", "CONFIG_KEYS", "DESCRIPTION", "FAMILY", "MODEL", "NAME", "PLAN", "VARIANT", "architecture",
           "detect", "load", "load_model", "original_plan", "weight_plan", "worker_from_model"]
