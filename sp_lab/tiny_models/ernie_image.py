"""Tiny random-weight ERNIE-Image models (diffusers' ErnieImageTransformer2DModel at ComfyUI's head size 128: 3 heads,
2 blocks, 128 latent channels, text width 40) and their files: ComfyUI names ERNIE-Image's weights as diffusers does,
with or without `model.diffusion_model.`, and diffusers folders."""
from __future__ import annotations

import torch

from .weights import plain_tiny

ERNIE_IMAGE_TINY = dict(hidden_size=384, num_attention_heads=3, num_layers=2, ffn_hidden_size=256, in_channels=128,
                        out_channels=128, patch_size=1, text_in_dim=40, rope_theta=256, rope_axes_dim=(32, 48, 48))

tiny_config, build_tiny_model = plain_tiny("ernie_image", "ErnieImageTransformer2DModel", ERNIE_IMAGE_TINY)


def original_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.detach() for key, value in model.state_dict().items()}
