"""How ComfyUI's host side sees HiDream-O1: its HiDreamO1 model class (supported_models.HiDreamO1: pixel space, a FLOW
model with multiplier 1000), whose extra_conds build the input ids and MRoPE positions the workers read."""
from __future__ import annotations

from ...contract import ComfyHost

COMFY = ComfyHost(model_classes={"": "HiDreamO1"}, unet_config=lambda info: {"image_model": "hidream_o1"},
                  attributes=lambda info: {"patch_size": info.config["patch_size"]})
