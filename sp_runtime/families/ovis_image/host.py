"""How ComfyUI's host side sees Ovis-Image: its Flux model, matched (no guidance embedder) as FluxSchnell by
ComfyUI's supported models, with the call's rope_options applied in the workers."""
from __future__ import annotations

from ...contract import ComfyHost, HostHooks

COMFY = ComfyHost(model_classes={"": "FluxSchnell"}, hooks=HostHooks(rope_options="applied"))
