"""LTX-Video 0.9's key plan: ComfyUI's (the release's) names -> diffusers' LTXVideoTransformer3DModel (the renames of
diffusers' convert_ltx_transformer checkpoint conversion)."""
from __future__ import annotations

from typing import Iterable

from ...checkpoints.loading import KeyPlan, original_layout_plan

RENAMES = (("patchify_proj.", "proj_in."), ("adaln_single.", "time_embed."), (".q_norm.", ".norm_q."),
           (".k_norm.", ".norm_k."))


def original_plan(keys: Iterable[str], config=None) -> KeyPlan:
    """ComfyUI key names -> parameters (LoRAs use these names too)."""
    return {key: [(renamed(key), None)] for key in keys}


def renamed(key: str) -> str:
    for old, new in RENAMES:
        if key.startswith(old) or old.startswith("."):
            key = key.replace(old, new)
    return key


weight_plan = original_layout_plan(original_plan)  # ComfyUI files through original_plan, diffusers' as they are
