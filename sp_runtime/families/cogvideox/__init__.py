"""CogVideoX 1.5 (T2V, I2V, CogVideoX-Fun inpainting: the official templates' VOID passes): ComfyUI's CogVideoX
`diffusion_model(x, timestep, context, ofs)` on diffusers' CogVideoXTransformer3DModel. x [B, C, T, H, W] (16
channels; the inpainting passes 48: the latent, then the 32-channel concat_latent_image of mask and masked video),
timestep raw (0-999), context [B, L, 4096] (T5 tokens).

Plan (plan.py): the video tokens split in balanced shards, each rank patch-embedding its own at their (frame, row,
column) rotary; the projected text replicated and leading every block's joint attention, through the same
projections as the video. detection.py reads the header, keys.py renames ComfyUI's keys, host.py ComfyUI's class.
The reference is sp_lab.references.cogvideox.
"""
from ..family import Family, PlanModel
from .detection import CLASS_NAME, CONFIG_KEYS, DESCRIPTION, NAME, detect
from .host import COMFY
from .keys import original_plan, weight_plan
from .plan import PLAN

MODEL = PlanModel(NAME, "CogVideoX", CLASS_NAME, detect, weight_plan, PLAN, 5, CONFIG_KEYS)
load, load_model = MODEL.load, MODEL.load_model

FAMILY = Family(NAME, DESCRIPTION, detect, load, COMFY, weight_plan, original_plan, load_model,
                signatures=("time_embedding_linear_1.weight",))  # ComfyUI's name

__all__ = ["COMFY", "CONFIG_KEYS", "DESCRIPTION", "FAMILY", "NAME", "PLAN", "detect", "load", "load_model",
           "original_plan", "weight_plan"]
