"""How ComfyUI's host side sees Flux.1: its model classes per variant and the unet_config entries they read."""
from __future__ import annotations

from ...contract import ComfyHost, HostHooks


COMFY = ComfyHost(model_classes={"schnell": "FluxSchnell", "fill": "FluxInpaint", "": "Flux"},
                  hooks=HostHooks(rope_options="applied"))
