"""HunyuanVideo 1.0 (T2V, I2V v1 concat, I2V v2 token replace, SkyReels I2V): ComfyUI's `diffusion_model(x,
timestep, context, y, guidance, attention_mask, guiding_frame_index, ref_latent)` on diffusers'
HunyuanVideoTransformer3DModel. x [B, C, T, H, W] (16 channels; I2V v1 33; SkyReels 32), timestep = sigma x 1000,
context [B, L, 4096] (LLaVA-Llama tokens), y [B, 768] (CLIP-L pooled), guidance raw (embedded x 1000),
guiding_frame_index (I2V v2), ref_latent (HunyuanImageToVideo's "custom" guidance: ahead of the video at frame -1).

Plan (plan.py): the image stream [reference, video] split in balanced shards, each rank patch-embedding its own
tokens at their (frame, row, column) rotary; the text (through the token refiner) replicated and joined after the
image tokens in the double- and single-stream blocks; token replace modulates the first frame's tokens wherever
they fall; each rank writes its own output tokens. HunyuanVideo 1.5 reuses this PLAN with its differences.
"""
from dataclasses import replace

from ..family import Family, PlanModel
from .detection import CONFIG_KEYS, NAME, architecture, detect
from .host import COMFY, comfy_attributes
from .keys import comfy_names, original_plan, weight_plan
from .plan import PLAN

# built with token-replace blocks (the same weights as the plain blocks; with no token to replace they compute those)
MODEL = PlanModel(NAME, "HunyuanVideo 1.0", "HunyuanVideoTransformer3DModel", detect, weight_plan, PLAN, 5,
                  CONFIG_KEYS, prepare=lambda detection, options: replace(
                      detection, config={**detection.config, "image_condition_type": "token_replace"}))
load, load_model = MODEL.load, MODEL.load_model

FAMILY = Family(NAME, "HunyuanVideo 1.0 (T2V, I2V concat / token replace, SkyReels I2V)", detect, load, COMFY,
                weight_plan, original_plan, load_model, gguf_architectures=("hyvid",))

__all__ = ["FAMILY", "CONFIG_KEYS", "COMFY", "NAME", "PLAN", "architecture", "comfy_attributes", "comfy_names",
           "detect", "load", "load_model", "MODEL", "original_plan", "weight_plan"]
