"""Tiny random-weight Qwen-Image 2.1 models (diffusers' QwenImage21Transformer2DModel: real head size 128, 5 heads,
2 blocks) and their files in ComfyUI's key layout (fused SwiGLU `img_mlp.gate_up`, gate rows first), as diffusers
single files and as diffusers folders. The package's API dispatches here. The ComfyUI writer fuses what the loader's
key plan splits, written separately so that a round trip checks both."""
from __future__ import annotations

import torch

from .weights import plain_tiny

QWEN21_TINY = dict(patch_size=1, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=128,
                   num_attention_heads=5, context_in_dim=32, mlp_ratio=3, axes_dims_rope=(16, 56, 56))


tiny_config, build_tiny_model = plain_tiny("qwen_image21", "QwenImage21Transformer2DModel", QWEN21_TINY,
                                           "axes_dims_rope")


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
