"""LTX-Video 0.9 (2B / 13B, text and image to video): ComfyUI's LTXV `diffusion_model(x, timestep, context,
attention_mask, frame_rate, keyframe_idxs)` on diffusers' LTXVideoTransformer3DModel.

detection.py reads the header (ComfyUI's keys or diffusers'; the release's `config` metadata), keys.py renames
ComfyUI's keys, plan.py is the sequence-parallel plan (video split, text replicated, per-token sigmas of image to
video sliced per rank, the whole-width rotary per rank), host.py what ComfyUI's LTXV class reads. The reference is
sp_lab.references.ltxv.
"""
from ..family import Family, PlanModel
from .detection import CLASS_NAME, CONFIG_KEYS, DESCRIPTION, NAME, detect
from .host import COMFY
from .keys import original_plan, weight_plan
from .plan import PLAN

MODEL = PlanModel(NAME, "LTX-Video", CLASS_NAME, detect, weight_plan, PLAN, 5, CONFIG_KEYS)
load, load_model = MODEL.load, MODEL.load_model

FAMILY = Family(NAME, DESCRIPTION, detect, load, COMFY, weight_plan, original_plan, load_model)

__all__ = ["COMFY", "CONFIG_KEYS", "DESCRIPTION", "FAMILY", "NAME", "PLAN", "detect", "load", "load_model",
           "original_plan", "weight_plan"]
