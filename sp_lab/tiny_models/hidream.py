"""Tiny random-weight HiDream models (diffusers' HiDreamImageTransformer2DModel at ComfyUI's 20 heads, of size 8;
2 double + 2 single blocks, 4 routed experts of which 2 active; T5 width 32, Llama width 24, one Llama layer per
block) and their files: ComfyUI names HiDream's weights as diffusers does, with or without
`model.diffusion_model.`, and diffusers folders."""
from __future__ import annotations

import torch

from .weights import plain_tiny

HIDREAM_TINY = dict(patch_size=2, in_channels=16, out_channels=16, num_layers=2, num_single_layers=2,
                    attention_head_dim=8, num_attention_heads=20, caption_channels=[32, 24], text_emb_dim=20,
                    num_routed_experts=4, num_activated_experts=2, axes_dims_rope=[4, 2, 2],
                    max_resolution=[128, 128], llama_layers=[0, 1, 2, 3])


tiny_config, build_tiny_model = plain_tiny("hidream", "HiDreamImageTransformer2DModel", HIDREAM_TINY)


def original_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.detach() for key, value in model.state_dict().items()}
