"""How ComfyUI's host side sees LongCat-Image: its LongCatImage model class (a Flux model; the class adds the rope
shifts, which reach the workers as the applied rope_options)."""
from __future__ import annotations

from ...contract import ComfyHost, HostHooks

COMFY = ComfyHost(model_classes={"": "LongCatImage"}, hooks=HostHooks(rope_options="applied"))
