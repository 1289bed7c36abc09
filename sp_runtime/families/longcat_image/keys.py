"""LongCat-Image's key plan: ComfyUI's Flux names -> diffusers' LongCatImageTransformer2DModel (Flux.1's plan, the time
embedder under `time_embed`)."""
from __future__ import annotations

from typing import Iterable

from ...checkpoints.loading import KeyPlan, original_layout_plan
from ..flux.keys import flux_key_plan

FLUX_TIME, OURS = "time_text_embed.timestep_embedder.", "time_embed.timestep_embedder."


def original_plan(keys: Iterable[str], config) -> KeyPlan:
    plan = flux_key_plan(keys, config["num_attention_heads"] * config["attention_head_dim"])
    return {key: [(target.replace(FLUX_TIME, OURS), transform) for target, transform in targets]
            for key, targets in plan.items()}


weight_plan = original_layout_plan(original_plan)
