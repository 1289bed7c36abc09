"""Qwen-Image's key plan: ComfyUI names Qwen-Image's weights as diffusers does (a `model.diffusion_model.` prefix
aside), so every layout loads as it is."""
from __future__ import annotations

from typing import Iterable, Optional

from ...checkpoints.loading import KeyPlan, identity_plan
from ...contract import Detection


def weight_plan(detection: Detection, keys: Iterable[str]) -> Optional[KeyPlan]:
    """How a checkpoint's keys (prefix stripped) become parameters, for load_model and for LoRA's re-reading of
    base weights: as they are (None), in every layout (see original_plan)."""
    return None


def original_plan(keys: Iterable[str], config) -> KeyPlan:
    """ComfyUI (original) key names -> parameters: ComfyUI names Qwen-Image's weights as diffusers does."""
    return identity_plan(keys)
