"""Ovis-Image's key plan: ComfyUI's Flux names -> diffusers' OvisImageTransformer2DModel as loading.py builds it (Flux.1's
plan; the time embedder at the top, the text norm, the SwiGLU MLPs' up / gate / down projections apart). Diffusers'
files keep up and gate in one tensor (`ff.net.0.proj`: [up; gate]): their plan splits it by rows."""
from __future__ import annotations

from typing import Iterable

from ...checkpoints.loading import KeyPlan, row_split
from ..flux.keys import SINGLE_FUSED, flux_key_plan
from .detection import MLP_RATIO

FLUX_TIME, OURS = "time_text_embed.timestep_embedder.", "timestep_embedder."
MLPS = {"img_mlp": "ff", "txt_mlp": "ff_context"}
PROJECTIONS = {"up_proj": "net.0.up_proj", "gate_proj": "net.0.gate_proj", "down_proj": "net.2"}


def original_plan(keys: Iterable[str], config) -> KeyPlan:
    keys, hidden = list(keys), config["num_attention_heads"] * config["attention_head_dim"]
    plan = {key: [(target.replace(FLUX_TIME, OURS), transform) for target, transform in targets]
            for key, targets in flux_key_plan(keys, hidden).items()}
    for key in keys:
        module, _, kind = key.rpartition(".")
        parts = module.split(".")
        if module == "txt_norm":
            plan[key] = [("context_embedder_norm.weight", None)]
        if len(parts) == 3 and parts[0] == "single_blocks" and parts[2] == "linear1":  # q, k, v, [up; gate]
            plan[key] = row_split(f"single_transformer_blocks.{parts[1]}.", SINGLE_FUSED, kind,
                                  (hidden,) * 3 + (2 * MLP_RATIO * hidden,))
        if len(parts) == 4 and parts[0] == "double_blocks" and parts[2] in MLPS and parts[3] in PROJECTIONS:
            plan[key] = [(f"transformer_blocks.{parts[1]}.{MLPS[parts[2]]}.{PROJECTIONS[parts[3]]}.{kind}", None)]
    return plan


def diffusers_plan(keys: Iterable[str], config) -> KeyPlan:
    """diffusers' names as they are, the fused SwiGLU projections split into up and gate."""
    width = MLP_RATIO * config["num_attention_heads"] * config["attention_head_dim"]
    plan = {}
    for key in keys:
        module, _, kind = key.rpartition(".")
        fused = module.endswith(".net.0.proj") and module.startswith("transformer_blocks.")
        plan[key] = (row_split(module[:-len("proj")], ("up_proj", "gate_proj"), kind, (width, width)) if fused
                     else [(key, None)])
    return plan


def weight_plan(detection, keys) -> KeyPlan:
    return (original_plan if detection.layout == "original" else diffusers_plan)(keys, detection.config)
