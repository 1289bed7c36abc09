"""HunyuanVideo 1.5's key plan: Tencent / ComfyUI names through 1.0's conversion (hunyuan_video.keys), into
1.5's `time_embed`."""
from __future__ import annotations

from typing import Iterable

from ...checkpoints.loading import KeyPlan, original_layout_plan
from ..hunyuan_video.keys import hunyuan_key_plan


def original_plan(keys: Iterable[str], config) -> KeyPlan:
    """Tencent / ComfyUI key names -> parameters of the model of `config` (LoRAs use these names too)."""
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    return hunyuan_key_plan(keys, hidden, 0, "time_embed")


weight_plan = original_layout_plan(original_plan)
