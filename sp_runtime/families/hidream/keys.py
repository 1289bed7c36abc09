"""HiDream key plan: ComfyUI names HiDream's weights as diffusers does (a `model.diffusion_model.` prefix aside), so
every layout loads as it is."""
from __future__ import annotations

from typing import Iterable, Optional

from ...checkpoints.loading import KeyPlan, identity_plan
from ...contract import Detection


def weight_plan(detection: Detection, keys: Iterable[str]) -> Optional[KeyPlan]:
    return None


def original_plan(keys: Iterable[str], config) -> KeyPlan:
    return identity_plan(keys)
