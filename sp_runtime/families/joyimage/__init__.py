"""JoyAI-Image-Edit (instruction editing with up to six reference images): ComfyUI's JoyImage `diffusion_model(x,
timestep, context, ref_latents)` (JoyImageTransformer3DModel, the Edit-Plus model) on diffusers' JoyImage blocks,
whose key names ComfyUI's files use (no key plan).

Plan (plan.py): the output latent's patch tokens and the reference latents' split over the ranks, each reference on
its own frame band of the rotary grid; the Qwen3-VL text replicated, after the image in every double-stream block's
joint attention, not rotated; the head writes the output's tokens. The reference is sp_lab.references.joyimage."""
from ...checkpoints.loading import diffusers_names as weight_plan, identity_plan as original_plan
from ..family import Family, PlanModel
from .detection import CLASS_NAME, CONFIG_KEYS, DESCRIPTION, NAME, architecture, detect
from .host import COMFY
from .plan import PLAN

MODEL = PlanModel(NAME, "JoyAI-Image-Edit", CLASS_NAME, detect, weight_plan, PLAN, 5, CONFIG_KEYS)
load, load_model = MODEL.load, MODEL.load_model

FAMILY = Family(NAME, DESCRIPTION, detect, load, COMFY, weight_plan, original_plan, load_model,
                signatures=(".attn.img_attn_qkv.weight",))

__all__ = ["COMFY", "CONFIG_KEYS", "DESCRIPTION", "FAMILY", "MODEL", "NAME", "PLAN", "architecture", "detect", "load",
           "load_model", "original_plan", "weight_plan"]
