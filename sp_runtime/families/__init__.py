"""Model families: header-only detection and the worker-side loaders, looked up by family name."""
from __future__ import annotations

import importlib

import torch

from ..groups import ParallelGroups
from .base import (Cancelled, CallContext, LoadRequest, ModelInfo, ProgressFn, WorkerModel,  # noqa: F401
                   dtype_name)

# family name -> module that defines `load(request, detection, device, groups, progress) -> WorkerModel`
FAMILY_MODULES = {
    "toy": "sp_runtime.families.toy",
    "qwen_image": "sp_runtime.families.qwen_image",
    "flux": "sp_runtime.families.flux",
    "wan": "sp_runtime.families.wan",
    "synthetic": "sp_runtime.cli.synthetic",  # random weights drawn on the workers (benchmark presets)
}


def load_worker_model(request: LoadRequest, device: torch.device, groups: ParallelGroups,
                      progress: ProgressFn) -> WorkerModel:
    """Detect the checkpoint's family from its header and load it on this worker's device."""
    from .detect import detect
    detection = detect(request.path)
    module = importlib.import_module(FAMILY_MODULES[detection.family])
    return module.load(request, detection, device, groups, progress)
