"""Anima's key plan: the DiT's keys as Cosmos-Predict2's (cosmos.keys), the LLM adapter's (`llm_adapter.*`, our
module in ComfyUI's names) as they are."""
from __future__ import annotations

from typing import Iterable

from ...checkpoints.loading import KeyPlan, original_layout_plan
from ..cosmos import keys as cosmos

ADAPTER = "llm_adapter."


def original_plan(keys: Iterable[str], config=None) -> KeyPlan:
    """ComfyUI key names -> parameters (LoRAs use these names too)."""
    keys = list(keys)
    plan = cosmos.original_plan([key for key in keys if not key.startswith(ADAPTER)], config)
    return {**plan, **{key: [(key, None)] for key in keys if key.startswith(ADAPTER)}}


weight_plan = original_layout_plan(original_plan)
