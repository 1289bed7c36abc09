"""Lens' key plan: ComfyUI's names are the loaded model's (loading.py names the rebuilt MLPs, norms and text norms as
ComfyUI does) but for the fused q / k / v of each stream, split by rows into diffusers' to_q / to_k / to_v
(`attn.img_qkv`) and add_q_proj / add_k_proj / add_v_proj (`attn.txt_qkv`)."""
from __future__ import annotations

from typing import Iterable

from ...checkpoints.loading import KeyPlan, original_layout_plan, row_split

FUSED = {"img_qkv": ("to_q", "to_k", "to_v"), "txt_qkv": ("add_q_proj", "add_k_proj", "add_v_proj")}


def original_plan(keys: Iterable[str], config) -> KeyPlan:
    width = config["num_attention_heads"] * config["attention_head_dim"]
    plan = {}
    for key in keys:
        module, _, kind = key.rpartition(".")
        stem, _, name = module.rpartition(".")
        plan[key] = (row_split(f"{stem}.", FUSED[name], kind, (width,) * 3)
                     if name in FUSED and stem.startswith("transformer_blocks.") else [(key, None)])
    return plan


weight_plan = original_layout_plan(original_plan)
