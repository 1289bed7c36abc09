"""Z-Image's key plan: ComfyUI's names -> diffusers', one key at a time (what diffusers'
convert_z_image_transformer_checkpoint_to_diffusers does): the fused qkv split into to_q, to_k, to_v, the embedder /
final layer and attention renames."""
from __future__ import annotations

from typing import Iterable

from ...checkpoints.loading import KeyPlan, original_layout_plan, row_split
from .detection import FUSED_QKV, UNUSED

TOP_RENAMES = {"x_embedder.": "all_x_embedder.2-1.", "final_layer.": "all_final_layer.2-1."}
ATTENTION_RENAMES = {".attention.out.": ".attention.to_out.0.", ".attention.q_norm.": ".attention.norm_q.",
                     ".attention.k_norm.": ".attention.norm_k."}


def original_plan(keys: Iterable[str], config) -> KeyPlan:
    """ComfyUI key names -> parameters (LoRAs use these names too); the fused qkv splits into to_q, to_k, to_v."""
    rows = config["dim"]
    plan = {}
    for key in keys:
        if key in UNUSED:
            continue
        if key.endswith(FUSED_QKV):
            plan[key] = row_split(key[:-len("qkv.weight")], ("to_q", "to_k", "to_v"), "weight", (rows,) * 3)
            continue
        target = key
        for old, new in TOP_RENAMES.items():
            if target.startswith(old):
                target = new + target[len(old):]
        for old, new in ATTENTION_RENAMES.items():
            target = target.replace(old, new)
        plan[key] = [(target, None)]
    return plan


weight_plan = original_layout_plan(original_plan)
