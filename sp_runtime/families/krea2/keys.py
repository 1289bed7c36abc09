"""Krea 2's key plan: ComfyUI's (the release's) names -> diffusers' Krea2Transformer2DModel (the renames of diffusers'
convert_krea2_transformer_checkpoint_to_diffusers; each block's six modulation vectors, stored flat, as [6, width])."""
from __future__ import annotations

from typing import Iterable

from ...checkpoints.loading import KeyPlan, original_layout_plan

TOP = (("first.", "img_in."), ("tmlp.0.", "time_embed.linear_1."), ("tmlp.2.", "time_embed.linear_2."),
       ("tproj.1.", "time_mod_proj."), ("txtmlp.0.scale", "txt_in.norm.weight"), ("txtmlp.1.", "txt_in.linear_1."),
       ("txtmlp.3.", "txt_in.linear_2."), ("txtfusion.", "text_fusion."), ("blocks.", "transformer_blocks."),
       ("last.linear.", "final_layer.linear."), ("last.norm.scale", "final_layer.norm.weight"),
       ("last.modulation.lin", "final_layer.scale_shift_table"))
INNER = ((".attn.wq.", ".attn.to_q."), (".attn.wk.", ".attn.to_k."), (".attn.wv.", ".attn.to_v."),
         (".attn.wo.", ".attn.to_out.0."), (".attn.gate.", ".attn.to_gate."),
         (".attn.qknorm.qnorm.scale", ".attn.norm_q.weight"), (".attn.qknorm.knorm.scale", ".attn.norm_k.weight"),
         (".mlp.", ".ff."), (".prenorm.scale", ".norm1.weight"), (".postnorm.scale", ".norm2.weight"),
         (".mod.lin", ".scale_shift_table"))


def original_plan(keys: Iterable[str], config=None) -> KeyPlan:
    """ComfyUI key names -> parameters (LoRAs use these names too)."""
    return {key: [_target(key)] for key in keys}


def _target(key: str):
    name = renamed(key)
    if name.startswith("transformer_blocks.") and name.endswith(".scale_shift_table"):
        return name, lambda tensor: tensor.reshape(6, -1)
    return name, None


def renamed(key: str) -> str:
    for old, new in TOP:
        if key.startswith(old):
            key = new + key[len(old):]
            break
    for old, new in INNER:
        key = key.replace(old, new)
    return key


weight_plan = original_layout_plan(original_plan)  # ComfyUI files through original_plan, diffusers' as they are
