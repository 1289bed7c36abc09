"""MiniMax H3 key plan: ComfyUI's names -> diffusers' MiniMaxH3Transformer3DModel parameters, as diffusers'
convert_minimax_h3_transformer_checkpoint_to_diffusers maps them (tests/test_minimax_h3.py checks the plan against
it): renames, the fused `[q; k; v]` split in thirds, the feed-forward's `[gate; value]` rows swapped to SwiGLU's
`[value; gate]`; the pruned form's `adaln_t_table` goes to the curve time embedder (loading.CurveTime), which
diffusers' converter refuses. `rope.inv_freq` (recomputed from the config) and the VSA gate (`to_gate_compress`,
unused by dense attention) carry no weights the forward reads."""
from __future__ import annotations

from typing import Iterable, Optional

from ...contract import Detection
from ...checkpoints.loading import KeyPlan, row_split, swap_halves

RENAMES = (("token_refiner.blocks.", "token_refiner.refiner_blocks."),
           ("time_embedder.proj_in.", "time_embedder.linear_1."), ("time_embedder.proj_out.", "time_embedder.linear_2."),
           ("video_patch_proj.", "proj_in."), ("audio_patch_proj.", "audio_proj_in."),
           ("condition_proj.", "context_embedder."), ("final_layer.norm.", "norm_out.norm."),
           ("final_layer.adaln_proj.linear.", "norm_out.linear."), ("final_layer.video_out.", "proj_out."),
           ("final_layer.audio_out.", "audio_proj_out."), (".attn.q_norm.", ".attn.norm_q."),
           (".attn.k_norm.", ".attn.norm_k."), (".attn.out_proj.", ".attn.to_out.0."),
           (".mlp.fc1.", ".ff.net.0.proj."), (".mlp.fc2.", ".ff.net.2."))
UNUSED = ("rope.inv_freq", ".attn.to_gate_compress.weight")


def weight_plan(detection: Detection, keys: Iterable[str]) -> Optional[KeyPlan]:
    return original_plan(keys, detection.config)


def original_plan(keys: Iterable[str], config) -> KeyPlan:
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    plan = {}
    for key in keys:
        if key.endswith(UNUSED):
            continue
        target = diffusers_name(key)
        if target.endswith(".attn.qkv_proj.weight"):
            plan[key] = row_split(target[:-len("qkv_proj.weight")], ("to_q", "to_k", "to_v"), "weight", (inner,) * 3)
        else:
            plan[key] = [(target, swap_halves if ".ff.net.0.proj." in target else None)]
    return plan


def diffusers_name(key: str) -> str:
    if key == "adaln_t_table":
        return "time_embedder.table"
    if key.startswith("blocks."):
        key = "transformer_blocks." + key[len("blocks."):]
    for old, new in RENAMES:
        key = key.replace(old, new)
    return key
