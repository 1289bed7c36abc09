"""The V3 extension ComfyUI gets from comfy_entrypoint(): the node list, plus the panel's routes and events."""
from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from . import server_routes
from .checkpoint_loader import SPCheckpointLoader
from .controlnet import SPControlNetLoader
from .loader import SPModelLoader
from .lora import SPLoraLoader
from .pool_control import SPPoolControl
from .random_conditioning import SPRandomConditioning

NODES = [SPModelLoader, SPCheckpointLoader, SPLoraLoader, SPPoolControl, SPRandomConditioning, SPControlNetLoader]


class UlyssesSPExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        server_routes.register()  # this ComfyUI version never calls on_load; registering here is idempotent
        return list(NODES)
