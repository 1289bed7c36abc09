"""Qwen-Image 2.1 (t2i, turbo, edit): ComfyUI's `diffusion_model(x, timestep, context, ref_latents, image_slots)`
(comfy/ldm/qwen_image21) on diffusers' QwenImage21Transformer2DModel.

Plan (plan.py): single-stream; text, reference latents (spliced into the text at their `image_slots`) and the target
form one sequence, split whole over the ranks, under a block-causal mask (text causal, each image block
bidirectional, every block sees all that precedes it) given to sp_attention as a SegmentMask.
"""
from ..family import Family, PlanModel, with_rope_axes_option
from .detection import CLASS_NAME, CONFIG_KEYS, NAME, architecture, detect
from .host import COMFY
from .keys import original_plan, weight_plan
from .plan import PLAN, JointLayout, joint_layout, slot_list

MODEL = PlanModel(NAME, "Qwen-Image 2.1", CLASS_NAME, detect, weight_plan, PLAN, 4, CONFIG_KEYS,
                  prepare=with_rope_axes_option,
                  channels=lambda model: (model.config.in_channels,
                                          model.config.out_channels or model.config.in_channels))
load, load_model, worker_from_model = MODEL.load, MODEL.load_model, MODEL.worker

FAMILY = Family(NAME, "Qwen-Image 2.1 (t2i, turbo, edit)", detect, load, COMFY, weight_plan, original_plan,
                load_model, gguf_architectures=("qwen_image",), signatures=("txt_in.text_norm.weight",))

__all__ = ["FAMILY", "CONFIG_KEYS", "COMFY", "NAME", "PLAN", "JointLayout", "architecture", "detect", "joint_layout",
           "load", "load_model", "original_plan", "slot_list", "weight_plan", "worker_from_model"]
