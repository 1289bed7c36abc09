"""Run by ComfyUI-Manager after it installs requirements.txt: checks the environment and says what is missing.

It never installs torch (ComfyUI owns torch and its CUDA build) and never fails the install: it only prints.
Run it by hand any time: `python install.py`.
"""
from __future__ import annotations

import importlib.util
import os
import sys

REQUIRED = ("torch", "diffusers", "safetensors", "psutil", "websockets", "accelerate", "gguf")
MIN_COMFYUI = (0, 3, 64)
HERE = os.path.dirname(os.path.abspath(__file__))


def missing_packages() -> list[str]:
    return [name for name in REQUIRED if importlib.util.find_spec(name) is None]


def comfyui_version() -> tuple[int, ...] | None:
    """Version of the ComfyUI this folder sits in (custom_nodes/<this>/..), if it can be read."""
    path = os.path.join(os.path.dirname(os.path.dirname(HERE)), "comfyui_version.py")
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("__version__"):
            return tuple(int(part) for part in line.split("=")[1].strip().strip("\"'").split(".")[:3])
    return None


def torch_report() -> list[str]:
    import torch
    lines = [f"torch {torch.__version__}"]
    if not torch.distributed.is_available():
        lines.append("WARNING: this torch build has no torch.distributed: ulysses-sp cannot start workers")
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        names = sorted({torch.cuda.get_device_name(index) for index in range(count)})
        lines.append(f"{count} CUDA GPU(s): {', '.join(names)}")
        if not torch.distributed.is_nccl_available():
            lines.append("WARNING: torch has no NCCL: GPU pools cannot start (install a CUDA build of torch)")
        if len(names) > 1:
            lines.append("note: mixed GPU models; the slowest GPU sets the pace of every step")
    else:
        lines.append("no CUDA GPU visible: use devices='cpu:2' in the loader to try it on the CPU")
    return lines


def main() -> int:
    print("ulysses-sp: checking the environment")
    missing = missing_packages()
    if missing:
        print(f"  missing packages {missing}: install them with\n"
              f"    {sys.executable} -m pip install -r {os.path.join(HERE, 'requirements.txt')}")
        if "torch" in missing:
            print("  torch itself comes with ComfyUI: install ComfyUI's own requirements first")
    version = comfyui_version()
    if version is not None and version < MIN_COMFYUI:
        print(f"  ComfyUI {'.'.join(map(str, version))} is older than the "
              f"{'.'.join(map(str, MIN_COMFYUI))} ulysses-sp needs (V3 nodes): update ComfyUI")
    if "torch" not in missing:
        for line in torch_report():
            print("  " + line)
    print("ulysses-sp: check done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
