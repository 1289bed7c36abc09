"""Single-device reference forwards per family: the independent side of every parity test (not product code).

`sp_lab.references.<family>.reference_forward(model, x, timestep, **inputs)` computes ComfyUI's
`diffusion_model(x, timestep, **inputs)` with diffusers' stock forward on one device.
"""
from __future__ import annotations

import importlib
from typing import Callable, Optional

import torch


def reference_forward(family: str) -> Callable:
    """The family's reference forward: here for the product's families; a family registered from elsewhere (the
    lab's toy, a test's throwaway family) holds it in its own module."""
    name = f"{__name__}.{family}"
    try:
        return importlib.import_module(name).reference_forward
    except ModuleNotFoundError as error:
        if error.name != name:
            raise
    from sp_runtime.families import family_module
    return family_module(family).reference_forward


def as_model(model_or_path, load_model: Callable, dtype: str = "default", options: Optional[dict] = None
             ) -> torch.nn.Module:
    """The model given, or the one the family's load_model reads from a checkpoint path."""
    if isinstance(model_or_path, torch.nn.Module):
        return model_or_path
    return load_model(model_or_path, dtype, options=options)[0]
