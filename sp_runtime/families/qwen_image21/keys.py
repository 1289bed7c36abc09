"""Qwen-Image 2.1's key plan: ComfyUI's names are diffusers' except the fused SwiGLU input (gate rows first)."""
from __future__ import annotations

from typing import Iterable

from ...checkpoints.loading import KeyPlan, original_layout_plan, row_split
from .detection import FUSED_MLP


def original_plan(keys: Iterable[str], config) -> KeyPlan:
    """ComfyUI key names -> parameters (LoRAs use these names too); the fused MLP splits into gate_layer, proj."""
    rows = config["mlp_ratio"] * config["num_attention_heads"] * config["attention_head_dim"]
    plan = {}
    for key in keys:
        module, _, kind = key.rpartition(".")
        if module.endswith(FUSED_MLP):
            stem = module[:-len("gate_up")]
            plan[key] = row_split(stem, ("gate_layer", "proj"), kind, (rows, rows))
        else:
            plan[key] = [(key, None)]
    return plan


weight_plan = original_layout_plan(original_plan)
