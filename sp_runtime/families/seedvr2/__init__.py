"""SeedVR2 (3B, 7B; video restoration / upscaling): ComfyUI's SeedVR2 `diffusion_model(x, timestep, context,
condition=...)` (comfy/ldm/seedvr NaDiT) on our own modules (model.py: diffusers has no SeedVR2 class).

Plan (plan.py): the video's patch tokens split over the ranks, the text replicated; windowed attention (plain and
shifted windows in alternate blocks, the text joined in every window and averaged over them) in a custom block that
all-gathers keys and values, so every layout computes exactly what one device does (why: plan.py's docstring).
The reference is sp_lab.references.seedvr2.
"""
from __future__ import annotations

from ..family import Family, PlanModel
from .detection import CONFIG_KEYS, DESCRIPTION, NAME, UNUSED, detect
from .host import COMFY
from .plan import PLAN
from ...checkpoints.loading import diffusers_names as weight_plan, identity_plan as original_plan


def build(model_class, config: dict, dtypes):
    """Our SeedVR2Model (meta weights; model_class is not used: diffusers has none)."""
    from accelerate import init_empty_weights

    from .model import SeedVR2Model
    with init_empty_weights():
        model = SeedVR2Model(config)
    if dtypes.layerwise:
        from diffusers.hooks import apply_layerwise_casting
        apply_layerwise_casting(model, storage_dtype=dtypes.storage, compute_dtype=dtypes.compute)
    return model


MODEL = PlanModel(NAME, "SeedVR2", "ModelMixin", detect, weight_plan, PLAN, 5, CONFIG_KEYS,
                  channels=lambda model: (model.config.in_channels - 17, model.config.out_channels), ignore=UNUSED,
                  build=build)
load, load_model, worker_from_model = MODEL.load, MODEL.load_model, MODEL.worker

FAMILY = Family(NAME, DESCRIPTION, detect, load, COMFY, weight_plan, original_plan, load_model,
                signatures=("vid_out.proj.weight", "positive_conditioning"))

__all__ = ["COMFY", "CONFIG_KEYS", "DESCRIPTION", "FAMILY", "MODEL", "NAME", "PLAN", "detect", "load", "load_model",
           "original_plan", "weight_plan", "worker_from_model"]
