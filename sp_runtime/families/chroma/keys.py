"""Chroma key plan: ComfyUI names -> diffusers' ChromaTransformer2DModel parameters. Flux.1's plan for the blocks,
embedders and output layer (Chroma's blocks are Flux's without modulation), plus the distilled guidance network's
renames (diffusers' convert_chroma_transformer_checkpoint_to_diffusers hardcodes the 3072 width, so it is not
called; tests/families/test_chroma.py checks the plan against it at full size)."""
from __future__ import annotations

from typing import Iterable

from .. import flux
from ...checkpoints.loading import KeyPlan, original_layout_plan
from .detection import GUIDANCE

GUIDANCE_RENAMES = {".in_layer.": ".linear_1.", ".out_layer.": ".linear_2.", ".scale": ".weight"}


def original_plan(keys: Iterable[str], config) -> KeyPlan:
    keys = list(keys)
    plan = flux.flux_key_plan([key for key in keys if not key.startswith(GUIDANCE)],
                              config["num_attention_heads"] * config["attention_head_dim"])
    for key in keys:
        if key.startswith(GUIDANCE + "."):
            target = key
            for old, new in GUIDANCE_RENAMES.items():
                target = target.replace(old, new)
            plan[key] = [(target, None)]
    return plan


weight_plan = original_layout_plan(original_plan)
