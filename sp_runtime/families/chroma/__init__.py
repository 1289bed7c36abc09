"""Chroma (HD and the v4x / v50 releases) and Chroma Radiance under Ulysses SP: Flux.1's architecture without
per-block modulation (one distilled guidance network gives every block its shift / scale / gate vectors), T5 text
only, on diffusers' ChromaTransformer2DModel; ComfyUI's `diffusion_model(x, timestep, context, guidance,
attention_mask)` (ComfyUI's Chroma / ChromaRadiance model classes).

detection.py reads the header, keys.py is Flux.1's key plan plus the guidance network's names, plan.py is flux.PLAN
with Chroma's differences (modulation per block from the approximator, single blocks fed the joined sequence, a text
padding mask). Radiance (variant "radiance", pixel space): radiance.py adds the per-patch NeRF head diffusers lacks,
radiance_plan.py runs the trunk and the NeRF blocks on each rank's own patches and the final 3x3 convolution on the
gathered image; one PlanModel per variant.
"""
from ..family import Family, PlanModel, by_variant
from . import radiance, radiance_plan
from .detection import CLASS_NAME, CONFIG_KEYS, DESCRIPTION, NAME, RADIANCE_KEYS, RADIANCE_MARKERS, detect
from .host import COMFY
from .keys import original_plan, weight_plan
from .plan import PATCH, PLAN

MODEL = PlanModel(NAME, "Chroma", CLASS_NAME, detect, weight_plan, PLAN, 4, CONFIG_KEYS, channels=lambda model: (
    model.config.in_channels // (PATCH * PATCH), model.proj_out.out_features // (PATCH * PATCH)))
RADIANCE = PlanModel(NAME, "Chroma", CLASS_NAME, detect, weight_plan, radiance_plan.PLAN, 4, CONFIG_KEYS,
                     ignore=tuple(RADIANCE_MARKERS.values()), build=radiance.build,
                     channels=lambda model: (model.config.in_channels // model.radiance.pixel_patch ** 2,) * 2,
                     describe=lambda model, detection: {key: detection.config[key] for key in RADIANCE_KEYS})
MODELS = {"": MODEL, "radiance": RADIANCE}

load_model, load = by_variant(MODELS, detect, NAME, "Chroma")  # the file's variant picks its model


FAMILY = Family(NAME, DESCRIPTION, detect, load, COMFY, weight_plan, original_plan, load_model,
                signatures=("distilled_guidance_layer.in_proj.weight",))

__all__ = ["COMFY", "DESCRIPTION", "FAMILY", "MODELS", "NAME", "PLAN", "detect", "load", "load_model",
           "original_plan", "weight_plan"]
