"""Ideogram 4's key plan: ComfyUI's names -> diffusers' Ideogram4Transformer2DModel parameters: the fused
`attention.qkv` split in thirds into to_q / to_k / to_v, `attention.o` -> `attention.to_out.0`; every other name
is the same in both."""
from __future__ import annotations

from typing import Iterable

from ...checkpoints.loading import KeyPlan, original_layout_plan, row_split

FUSED_QKV = ".attention.qkv.weight"


def original_plan(keys: Iterable[str], config) -> KeyPlan:
    width = config["num_attention_heads"] * config["attention_head_dim"]
    plan = {}
    for key in keys:
        if key.endswith(FUSED_QKV):
            plan[key] = row_split(key[:-len("qkv.weight")], ("to_q", "to_k", "to_v"), "weight", (width,) * 3)
        else:
            plan[key] = [(key.replace(".attention.o.", ".attention.to_out.0."), None)]
    return plan


weight_plan = original_layout_plan(original_plan)
