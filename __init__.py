"""ComfyUI entry point of ulysses-sp; importing it without ComfyUI is safe and does nothing heavy."""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    # Appended, not inserted: ComfyUI has a top-level `nodes` module that ours must not shadow. Worker processes
    # import `sp_runtime` by this real name.
    sys.path.append(_HERE)

WEB_DIRECTORY = "./web"
