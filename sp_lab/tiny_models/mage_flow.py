"""Tiny random-weight Mage-Flow models: diffusers' QwenImageTransformer2DModel at patch 1 on the released 128
latent channels and 2560-wide text (the two widths detection reads), 6 heads of 16, 2 blocks. ComfyUI's files use
diffusers' key names, so the model is saved as built."""
from __future__ import annotations

import torch

from .weights import plain_tiny

MAGE_FLOW_TINY = dict(patch_size=1, in_channels=128, out_channels=128, num_layers=2, attention_head_dim=16,
                      num_attention_heads=6, joint_attention_dim=2560, axes_dims_rope=(4, 6, 6))

tiny_config, build_tiny_model = plain_tiny("mage_flow", "QwenImageTransformer2DModel", MAGE_FLOW_TINY,
                                           "axes_dims_rope")


def original_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """ComfyUI's names: diffusers' own."""
    return {key: value.detach() for key, value in model.state_dict().items()}
