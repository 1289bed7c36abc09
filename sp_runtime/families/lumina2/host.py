"""How ComfyUI's host side sees Lumina 2: its model class (supported_models.Lumina2, NextDiT without Z-Image's
options), its patch; ScaleROPE's rope_options applied in the workers."""
from __future__ import annotations

from ...contract import ComfyHost, HostHooks
from .detection import PATCH


COMFY = ComfyHost(model_classes={"": "Lumina2"}, unet_config=lambda info: {"in_channels": info.in_channels},
                  attributes=lambda info: {"patch_size": PATCH, "pad_tokens_multiple": None},
                  hooks=HostHooks(rope_options="applied"))
