"""Tiny random-weight Qwen-Image 2.1 models (diffusers' QwenImage21Transformer2DModel: real head size 128, 5 heads,
2 blocks) and their files in ComfyUI's key layout (fused SwiGLU `img_mlp.gate_up`, gate rows first), as diffusers
single files and as diffusers folders. The package's API dispatches here. The ComfyUI writer fuses what the loader's
key plan splits, written separately so that a round trip checks both."""
from __future__ import annotations

import os
from typing import Optional

import torch

from .weights import cast_like_release, randomize_, save_folder

QWEN21_TINY = dict(patch_size=1, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=128,
                   num_attention_heads=5, context_in_dim=32, mlp_ratio=3, axes_dims_rope=(16, 56, 56))


def tiny_config(**size) -> dict:
    config = dict(QWEN21_TINY)
    unknown = set(size) - set(config)
    if unknown:
        raise ValueError(f"unknown size options {sorted(unknown)} for qwen_image21; known: {sorted(config)}")
    config.update(size)
    if "attention_head_dim" in size and "axes_dims_rope" not in size:
        from sp_runtime.sp.tokens import rope_axes
        config["axes_dims_rope"] = rope_axes(config["attention_head_dim"])
    return config


def build_tiny_model(seed: int = 0, **size) -> torch.nn.Module:
    from diffusers import QwenImage21Transformer2DModel
    model = QwenImage21Transformer2DModel.from_config(tiny_config(**size))
    randomize_(model, seed)
    return model.eval().requires_grad_(False)


def original_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """ComfyUI's names: diffusers' with each block's gate_layer and proj stacked into img_mlp.gate_up."""
    state = {key: value.detach() for key, value in model.state_dict().items()}
    out = {}
    for key, value in state.items():
        if key.endswith("img_mlp.gate_layer.weight"):
            out[key.replace("gate_layer", "gate_up")] = torch.cat([value, state[key.replace("gate_layer", "proj")]])
        elif not key.endswith("img_mlp.proj.weight"):
            out[key] = value
    return out


def write_tiny_checkpoint(path: str, layout: str, dtype: str, seed: int, prefix: str,
                          max_shard_size: Optional[str], **size) -> str:
    from safetensors.torch import save_file
    model = build_tiny_model(seed, **size)
    if layout == "diffusers_folder":
        save_folder(model, path, dtype, max_shard_size)
        return path
    state = original_state_dict(model) if layout == "original" else model.state_dict()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file({prefix + key: value for key, value in cast_like_release(state, dtype).items()}, path)
    return path
