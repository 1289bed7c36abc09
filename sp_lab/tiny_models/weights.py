"""What every tiny model shares: seeded random weights of a sane scale, and saving them as released files are."""
from __future__ import annotations

import math
import os
from typing import Callable, Optional

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


def sized(family: str, defaults: dict, size: dict, rope_key: str = "") -> dict:
    """`defaults` with `size` overriding; ValueError naming options it does not know. rope_key: the config entry
    of the rotary axes, derived from a new attention_head_dim unless `size` gives it too."""
    unknown = set(size) - set(defaults)
    if unknown:
        raise ValueError(f"unknown size options {sorted(unknown)} for {family}; known: {sorted(defaults)}")
    config = {**defaults, **size}
    if rope_key and "attention_head_dim" in size and rope_key not in size:
        from sp_runtime.sp.tokens import rope_axes
        config[rope_key] = rope_axes(config["attention_head_dim"])
    return config


def random_model(class_name: str, config: dict, seed: int) -> torch.nn.Module:
    """A float32 diffusers `class_name` model of `config` with seeded random weights, in eval mode."""
    import diffusers
    model = getattr(diffusers, class_name).from_config(config)
    randomize_(model, seed)
    return model.eval().requires_grad_(False)


def plain_tiny(family: str, class_name: str, defaults: dict, rope_key: str = "") -> tuple[Callable, Callable]:
    """(tiny_config(**size), build_tiny_model(seed=0, **size)) of a family whose tiny model is diffusers'
    `class_name` at `defaults` (`size` overriding, see sized) with seeded random weights."""
    def tiny_config(**size) -> dict:
        return sized(family, defaults, size, rope_key)

    def build_tiny_model(seed: int = 0, **size) -> torch.nn.Module:
        return random_model(class_name, tiny_config(**size), seed)
    return tiny_config, build_tiny_model


def save_tiny(model: torch.nn.Module, path: str, layout: str, dtype: str, prefix: str = "",
              max_shard_size: Optional[str] = None, original: Optional[Callable] = None, extra: Optional[dict] = None,
              metadata: Optional[dict] = None) -> str:
    """Save a tiny model as released files are: a diffusers folder ("diffusers_folder"), or one safetensors file
    with `prefix` on every key, in the original layout (`original(model)`: ComfyUI's names) or diffusers'.
    extra: tensors added as they are (marker tensors). Returns the path."""
    from safetensors.torch import save_file
    if layout == "diffusers_folder":
        save_folder(model, path, dtype, max_shard_size)
        return path
    state = {**cast_like_release(original(model) if layout == "original" else model.state_dict(), dtype),
             **(extra or {})}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file({prefix + key: value for key, value in state.items()}, path, metadata=metadata)
    return path


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
