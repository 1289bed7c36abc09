"""Tiny random-weight Kandinsky 5 models (diffusers' Kandinsky5Transformer3DModel: 5 heads of ComfyUI's head size
64 for this width (axes (16, 24, 24)), 1 text block, 2 visual blocks, 32-wide text and 24-wide pooled text); the
video model (latent, image latent and mask channels) by default, the image model with variant="image". The
release names the weights as diffusers does, so ComfyUI's layout is diffusers' single file."""
from __future__ import annotations

import torch

from .weights import random_model, save_tiny, sized

KANDINSKY5_TINY = dict(in_visual_dim=16, in_text_dim=32, in_text_dim2=24, time_dim=48, out_visual_dim=16,
                       patch_size=(1, 2, 2), model_dim=320, ff_dim=64, num_text_blocks=1, num_visual_blocks=2,
                       axes_dims=(16, 24, 24), visual_cond=True)


def tiny_config(**size) -> dict:
    return sized("kandinsky5", KANDINSKY5_TINY, size)


def build_tiny_model(seed: int = 0, variant: str = "", **size) -> torch.nn.Module:
    return random_model("Kandinsky5Transformer3DModel",
                        tiny_config(**({"visual_cond": False} if variant == "image" else {}), **size), seed)


def original_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.detach() for key, value in model.state_dict().items()}


def write_tiny_checkpoint(path: str, layout: str = "original", dtype: str = "float32", seed: int = 0,
                          prefix: str = "", variant: str = "", max_shard_size=None, **size) -> str:
    model = build_tiny_model(seed, variant, **size)
    return save_tiny(model, path, layout, dtype, prefix, max_shard_size, original_state_dict)
