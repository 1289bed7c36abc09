"""Tiny random-weight LongCat-Image models (diffusers' LongCatImageTransformer2DModel: 6 heads of 16, 2 + 2 blocks,
ComfyUI's text width 3584, by which its detection knows the model) and their ComfyUI files (Flux.1's key layout with
no vector_in / guidance_in), written apart from the loader's key plan."""
from __future__ import annotations

import torch

from .weights import plain_tiny

LONGCAT_TINY = dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=16,
                    num_attention_heads=6, joint_attention_dim=3584, pooled_projection_dim=3584,
                    axes_dims_rope=(4, 6, 6))

tiny_config, build_tiny_model = plain_tiny("longcat_image", "LongCatImageTransformer2DModel", LONGCAT_TINY,
                                           "axes_dims_rope")


def original_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from . import _flux_to_original  # the Flux.1 writer (this module is imported by the package's __init__)
    state = {key.replace("time_embed.timestep_embedder.", "time_text_embed.timestep_embedder."): value.detach()
             for key, value in model.state_dict().items()}
    return _flux_to_original(state, model.config.num_layers, model.config.num_single_layers)
