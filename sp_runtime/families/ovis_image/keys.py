"""Ovis-Image's key plan: ComfyUI's Flux names -> diffusers' OvisImageTransformer2DModel as loading.py builds it (Flux.1's
plan; the time embedder at the top, the text norm, the SwiGLU MLPs' up / gate / down projections apart, the single
blocks' fused linear1 rows: q, k, v, up, gate). Diffusers' files keep up and gate in one tensor (`ff.net.0.proj`,
`proj_mlp`: [up; gate]): their plan splits it by rows."""
from __future__ import annotations

from typing import Iterable

from ...checkpoints.loading import KeyPlan, row_split
from ..flux.keys import flux_key_plan
from .detection import MLP_RATIO

FLUX_TIME, OURS = "time_text_embed.timestep_embedder.", "timestep_embedder."
MLPS = {"img_mlp": "ff", "txt_mlp": "ff_context"}
PROJECTIONS = {"up_proj": "net.0.up_proj", "gate_proj": "net.0.gate_proj", "down_proj": "net.2"}
SINGLE_FUSED = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp.up_proj", "proj_mlp.gate_proj")


def original_plan(keys: Iterable[str], config) -> KeyPlan:
    keys, hidden = list(keys), config["num_attention_heads"] * config["attention_head_dim"]
    plan = {key: [(target.replace(FLUX_TIME, OURS), transform) for target, transform in targets]
            for key, targets in flux_key_plan(keys, hidden).items()}
    for key in keys:
        module, _, kind = key.rpartition(".")
        parts = module.split(".")
        if module == "txt_norm":
            plan[key] = [("context_embedder_norm.weight", None)]
        if len(parts) == 3 and parts[0] == "single_blocks" and parts[2] == "linear1":  # q, k, v, up, gate
            plan[key] = row_split(f"single_transformer_blocks.{parts[1]}.", SINGLE_FUSED, kind,
                                  (hidden,) * 3 + (MLP_RATIO * hidden,) * 2)
        if len(parts) == 4 and parts[0] == "double_blocks" and parts[2] in MLPS and parts[3] in PROJECTIONS:
            plan[key] = [(f"transformer_blocks.{parts[1]}.{MLPS[parts[2]]}.{PROJECTIONS[parts[3]]}.{kind}", None)]
    return plan


def diffusers_plan(keys: Iterable[str], config) -> KeyPlan:
    """diffusers' names as they are, the fused SwiGLU projections ([up; gate]) split into up and gate."""
    width = MLP_RATIO * config["num_attention_heads"] * config["attention_head_dim"]
    plan = {}
    for key in keys:
        module, _, kind = key.rpartition(".")
        double = module.endswith(".net.0.proj") and module.startswith("transformer_blocks.")
        single = module.endswith(".proj_mlp") and module.startswith("single_transformer_blocks.")
        stem = module[:-len("proj")] if double else f"{module}." if single else ""
        plan[key] = (row_split(stem, ("up_proj", "gate_proj"), kind, (width, width)) if stem else [(key, None)])
    return plan


def weight_plan(detection, keys) -> KeyPlan:
    return (original_plan if detection.layout == "original" else diffusers_plan)(keys, detection.config)
