"""Lumina 2's key plan: ComfyUI's (the original release's) names -> diffusers', one key at a time (what diffusers'
convert_lumina2_to_diffusers does): the fused qkv split into to_q, to_k, to_v (grouped: fewer key / value rows),
the caption / time embedders, block norms and final layer renamed."""
from __future__ import annotations

from typing import Iterable

from ...checkpoints.loading import KeyPlan, original_layout_plan, row_split
from .detection import UNUSED

FUSED_QKV = ".attention.qkv.weight"
TOP_RENAMES = {"cap_embedder.": "time_caption_embed.caption_embedder.",
               "t_embedder.mlp.0.": "time_caption_embed.timestep_embedder.linear_1.",
               "t_embedder.mlp.2.": "time_caption_embed.timestep_embedder.linear_2.",
               "final_layer.adaLN_modulation.1.": "norm_out.linear_1.", "final_layer.linear.": "norm_out.linear_2."}
BLOCK_RENAMES = {".attention.out.": ".attn.to_out.0.", ".attention.q_norm.": ".attn.norm_q.",
                 ".attention.k_norm.": ".attn.norm_k.", ".adaLN_modulation.1.": ".norm1.linear.",
                 ".attention_norm2.": ".norm2.", ".feed_forward.w1.": ".feed_forward.linear_1.",
                 ".feed_forward.w2.": ".feed_forward.linear_2.", ".feed_forward.w3.": ".feed_forward.linear_3."}


def original_plan(keys: Iterable[str], config) -> KeyPlan:
    """ComfyUI key names -> parameters (LoRAs use these names too); the fused qkv splits into to_q, to_k, to_v."""
    dim = config["hidden_size"]
    kv_rows = dim // config["num_attention_heads"] * config["num_kv_heads"]
    plan = {}
    for key in keys:
        if key in UNUSED:
            continue
        if key.endswith(FUSED_QKV):
            stem = key[:-len(FUSED_QKV)] + ".attn."
            plan[key] = row_split(stem, ("to_q", "to_k", "to_v"), "weight", (dim, kv_rows, kv_rows))
            continue
        plan[key] = [(_renamed(key), None)]
    return plan


weight_plan = original_layout_plan(original_plan)


def _renamed(key: str) -> str:
    for old, new in TOP_RENAMES.items():
        if key.startswith(old):
            return new + key[len(old):]
    modulated = not key.startswith("context_refiner.")  # its blocks have a plain norm1, the others norm1.norm
    key = key.replace(".attention_norm1.", ".norm1.norm." if modulated else ".norm1.")
    for old, new in BLOCK_RENAMES.items():
        key = key.replace(old, new)
    return key
