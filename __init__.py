"""ComfyUI entry point of ulysses-sp; importing it without ComfyUI is safe and does nothing heavy.

ComfyUI finds the V3 extension through `comfy_entrypoint` (no NODE_CLASS_MAPPINGS on purpose: ComfyUI would then
ignore the V3 entry point) and serves the panel from WEB_DIRECTORY.
"""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    # Appended, not inserted: ComfyUI has a top-level `nodes` module that ours must not shadow. Worker processes
    # import `sp_runtime` by this real name.
    sys.path.append(_HERE)

WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    """Called by ComfyUI once its modules are importable; the nodes import ComfyUI only from here on."""
    from .nodes.extension import UlyssesSPExtension
    return UlyssesSPExtension()
