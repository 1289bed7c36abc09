"""Flux.2's key plan: diffusers' own converter, asked one key at a time (every rule of
convert_flux2_transformer_checkpoint_to_diffusers looks at one key and splits by thirds, so it is width-independent
and streams)."""
from __future__ import annotations

from typing import Iterable

import torch

from ...checkpoints.loading import KeyPlan, original_layout_plan


def original_plan(keys: Iterable[str], config=None) -> KeyPlan:
    """Original key -> [(diffusers key, transform)], each transform diffusers' converter applied to that tensor.

    The names come from converting a 6-row meta tensor (fused qkv splits in thirds, the final modulation in
    halves), so planning reads no weights."""
    plan = {}
    for key in keys:
        names = list(_convert({key: torch.empty(6, device="meta")}))
        plan[key] = [(name, _converted(key, name)) for name in names]
    return plan


weight_plan = original_layout_plan(original_plan)


def _convert(state: dict) -> dict:
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers
    return convert_flux2_transformer_checkpoint_to_diffusers(state)


def _converted(key: str, name: str):
    return lambda tensor: _convert({key: tensor})[name]
