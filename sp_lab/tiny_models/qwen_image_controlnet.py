"""A tiny Qwen-Image InstantX ControlNet (diffusers' QwenImageControlNetModel at the tiny Qwen-Image's widths); ComfyUI
and the InstantX release both name its weights as diffusers does."""
from __future__ import annotations

import torch

from .weights import plain_tiny

# 12 blocks: ComfyUI spreads each residual over 5 of 60 main-model blocks, so a 6-block model sees two of them
TINY = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=12, attention_head_dim=16,
            num_attention_heads=6, joint_attention_dim=32, axes_dims_rope=(4, 6, 6), extra_condition_channels=0)
tiny_config, build_tiny_model = plain_tiny("qwen_image_controlnet", "QwenImageControlNetModel", TINY, "axes_dims_rope")


def original_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.detach() for key, value in model.state_dict().items()}
