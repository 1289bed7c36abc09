"""What every tiny model shares: seeded random weights of a sane scale, and saving them as released files are."""
from __future__ import annotations

import math
from typing import Optional

import torch

from sp_runtime.checkpoints.dtypes import DTYPES

COMFY_PREFIX = "model.diffusion_model."


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Replace every weight with seeded random values of a sane scale.

    Nothing stays at its default (zeros, ones): a zero output layer or a unit norm would hide a wrong wiring.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if parameter.dim() >= 2:
                parameter.copy_(noise / math.sqrt(parameter.shape[1]))
            elif "norm" in name:
                parameter.copy_(1 + 0.1 * noise)
            else:
                parameter.copy_(0.1 * noise)


def cast_like_release(state: dict, dtype: str) -> dict[str, torch.Tensor]:
    """Cast as released files are: fp8 files keep matrices in fp8 and vectors (biases, norms) in bf16."""
    from sp_runtime.checkpoints.dtypes import DTYPES
    target = DTYPES[dtype]
    if target in (torch.float8_e4m3fn, torch.float8_e5m2):
        return {k: v.to(target if v.dim() >= 2 else torch.bfloat16).contiguous() for k, v in state.items()}
    return {k: v.to(target).contiguous() for k, v in state.items()}


def save_folder(model: torch.nn.Module, path: str, dtype: str, max_shard_size: Optional[str]) -> None:
    target = DTYPES[dtype]
    if target in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError("diffusers folders are written in float dtypes only (fp8 files are single files)")
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(target).save_pretrained(path, safe_serialization=True, **kwargs)


def pack_all_in_one(diffusion_path: str, path: str, parts: dict[str, torch.Tensor],
                    metadata: Optional[dict] = None) -> str:
    """An all-in-one checkpoint as ComfyUI's "Load Checkpoint" takes: a diffusion file's tensors (written with
    COMFY_PREFIX) and `parts` (text encoder / VAE entries under their own prefixes) in one file."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    with safe_open(diffusion_path, framework="pt") as handle:
        state = {key: handle.get_tensor(key) for key in handle.keys()}
        metadata = {**(handle.metadata() or {}), **(metadata or {})}
    if not all(key.startswith(COMFY_PREFIX) for key in state):
        raise ValueError(f"{diffusion_path!r} must keep its diffusion model under {COMFY_PREFIX!r}")
    save_file({**state, **parts}, path, metadata=metadata)
    return path
