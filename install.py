"""Run by ComfyUI-Manager after requirements.txt: checks the environment; never installs torch."""
import importlib.util
import sys

missing = [name for name in ("torch", "diffusers", "safetensors", "psutil") if importlib.util.find_spec(name) is None]
if missing:
    print(f"ulysses-sp: missing packages {missing}; install with: {sys.executable} -m pip install -r requirements.txt")
