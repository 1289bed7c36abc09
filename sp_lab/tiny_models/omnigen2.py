"""Tiny random-weight OmniGen2 models (diffusers' Lumina 2 blocks with the product's reference modules: 6 query heads
over 2 key / value heads of size 24, 1 refiner block per stream, 2 main blocks) and their files in ComfyUI's key
layout, which is the model's own (OmniGen2 files name weights as diffusers' Lumina 2 does)."""
from __future__ import annotations

import torch

from .weights import random_model, randomize_, sized

OMNIGEN2_TINY = dict(patch_size=2, in_channels=16, hidden_size=144, num_layers=2, num_refiner_layers=1,
                     num_attention_heads=6, num_kv_heads=2, multiple_of=256, ffn_dim_multiplier=None,
                     cap_feat_dim=32, axes_dim_rope=(8, 8, 8), axes_lens=(1024, 1664, 1664))


def tiny_config(**size) -> dict:
    return sized("omnigen2", OMNIGEN2_TINY, size)


def build_tiny_model(seed: int = 0, **size) -> torch.nn.Module:
    from sp_runtime.families.omnigen2 import add_reference_modules
    model = random_model("Lumina2Transformer2DModel", tiny_config(**size), seed)
    add_reference_modules(model)
    randomize_(model, seed)
    return model.eval().requires_grad_(False)


def original_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.detach() for key, value in model.state_dict().items()}
