"""Boogu-Image (base, turbo, edit): ComfyUI's Boogu `diffusion_model(x, timestep, context, num_tokens, ref_latents)`
(BooguTransformer2DModel: OmniGen2's refiners and single-stream blocks with a double-stream stage between, Qwen3-VL
instructions) on modules.py's model: diffusers' Lumina2Transformer2DModel with the modules it lacks, under
ComfyUI's key names (the files load as they are).

Plan (plan.py): instruction, reference latents and latent are three split streams; each refiner attends within its
stream, the double-stream blocks (a custom block) jointly over all three with per-stream projections and over the
images alone, the single-stream blocks over their rank-wise union; the head writes each rank's latent tokens. The
reference is sp_lab.references.boogu.
"""
from ...checkpoints.loading import diffusers_names as weight_plan, identity_plan as original_plan
from ..family import Family, PlanModel
from .detection import CLASS_NAME, CONFIG_KEYS, DESCRIPTION, NAME, PATCH, VARIANT, architecture, detect
from .host import COMFY
from .plan import PLAN

SIGNATURES = ("img_instruct_attn.processor.img_to_q.weight",)


def _build(model_class, config, dtypes):
    from .modules import build_model
    return build_model(model_class, config, dtypes)


def _describe(model, detection) -> dict:
    return {"num_double_stream_layers": detection.config["num_double_stream_layers"]}


MODEL = PlanModel(NAME, "Boogu-Image", CLASS_NAME, detect, weight_plan, PLAN, 4, CONFIG_KEYS, build=_build,
                  describe=_describe, channels=lambda model: (model.config.in_channels, model.config.in_channels))
load, load_model, worker_from_model = MODEL.load, MODEL.load_model, MODEL.worker

FAMILY = Family(NAME, DESCRIPTION, detect, load, COMFY, weight_plan, original_plan, load_model,
                signatures=SIGNATURES)

__all__ = ["COMFY", "CONFIG_KEYS", "DESCRIPTION", "FAMILY", "MODEL", "NAME", "PATCH", "PLAN", "VARIANT",
           "architecture", "detect", "load", "load_model", "original_plan", "weight_plan", "worker_from_model"]
