"""Tiny random-weight JoyAI-Image-Edit models: diffusers' JoyImageEditTransformer3DModel (6 heads of 16, 2 blocks, a
32-wide text, ComfyUI's theta 10000). ComfyUI's files use diffusers' key names, so the model is saved as built."""
from __future__ import annotations

import torch

from .weights import plain_tiny

JOYIMAGE_TINY = dict(patch_size=[1, 2, 2], in_channels=16, out_channels=16, hidden_size=96, num_attention_heads=6,
                     text_dim=32, mlp_width_ratio=4.0, num_layers=2, rope_dim_list=[4, 6, 6], theta=10000)

tiny_config, build_tiny_model = plain_tiny("joyimage", "JoyImageEditTransformer3DModel", JOYIMAGE_TINY)


def original_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """ComfyUI's names: diffusers' own."""
    return {key: value.detach() for key, value in model.state_dict().items()}
