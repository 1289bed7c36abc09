"""Tiny random-weight Ovis-Image models (diffusers' OvisImageTransformer2DModel: 6 heads of 16, 2 + 2 blocks) and their
ComfyUI files (Flux.1's key layout with no vector_in / guidance_in, `txt_norm`, and the double blocks' SwiGLU MLPs as
`up_proj` / `gate_proj` / `down_proj`), written apart from the loader's key plan."""
from __future__ import annotations

import torch

from .weights import plain_tiny

OVIS_TINY = dict(patch_size=1, in_channels=64, out_channels=64, num_layers=2, num_single_layers=2,
                 attention_head_dim=16, num_attention_heads=6, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))

tiny_config, build_tiny_model = plain_tiny("ovis_image", "OvisImageTransformer2DModel", OVIS_TINY, "axes_dims_rope")


def original_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from . import _flux_to_original  # the Flux.1 writer (this module is imported by the package's __init__)
    state = {key.replace("timestep_embedder.", "time_text_embed.timestep_embedder.", 1)
             if key.startswith("timestep_embedder.") else key: value.detach()
             for key, value in model.state_dict().items()}
    out = _flux_to_original(state, model.config.num_layers, model.config.num_single_layers)
    for key in [key for key in out if ".img_mlp." in key or ".txt_mlp." in key]:
        stem, index, kind = key.rsplit(".", 2)
        if index == "0":  # diffusers' SwiGLU rows: [up; gate]
            out[f"{stem}.up_proj.{kind}"], out[f"{stem}.gate_proj.{kind}"] = out.pop(key).chunk(2)
        else:
            out[f"{stem}.down_proj.{kind}"] = out.pop(key)
    out["txt_norm.scale"] = state["context_embedder_norm.weight"]
    return out
