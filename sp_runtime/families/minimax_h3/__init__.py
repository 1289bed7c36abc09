"""MiniMax H3 (audio + video, one packed sequence) under Ulysses SP: diffusers' MiniMaxH3Transformer3DModel fed
ComfyUI's `diffusion_model([video, audio], timestep, context, minimax_payload=...)` (ComfyUI's MiniMaxH3 class).

detection.py reads the header (ComfyUI's keys, with or without `model.diffusion_model.`; the pruned curve form and
FastH3's head bank), keys.py maps ComfyUI names to diffusers', loading.py builds the model, plan.py is the
sequence-parallel forward (one split stream [text | keyframes | audio | video], full self-attention per block, AdaLN
per row), host.py is what ComfyUI's host side reads and how it packs the call.
"""
from ..family import Family
from .detection import DESCRIPTION, NAME, detect
from .host import COMFY
from .keys import original_plan, weight_plan
from .loading import load, load_model
from .plan import PLAN

FAMILY = Family(NAME, DESCRIPTION, detect, load, COMFY, weight_plan, original_plan, load_model,
                signatures=("audio_patch_proj.weight",))

__all__ = ["COMFY", "DESCRIPTION", "FAMILY", "NAME", "PLAN", "detect", "load", "load_model", "original_plan",
           "weight_plan"]
