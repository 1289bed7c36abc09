"""Tiny random-weight LTX-Video 0.9 models (diffusers' LTXVideoTransformer3DModel: 5 heads of size 16, so the
80-wide rotary table has ComfyUI's leading identity channels, 2 blocks, a 32-wide T5 stand-in) and their files in
ComfyUI's key layout (`patchify_proj`, `adaln_single`, `q_norm` / `k_norm`), each with the release's `config`
metadata stating the heads (ComfyUI's default is 32) and the first frame's causal positions, as 0.9.5 does;
written separately from the loader's key plan so that a round trip checks both."""
from __future__ import annotations

import json

import torch

from .weights import random_model, save_tiny, sized

LTXV_TINY = dict(in_channels=16, out_channels=16, num_attention_heads=5, attention_head_dim=16,
                 cross_attention_dim=80, num_layers=2, caption_channels=32, causal_temporal_positioning=True,
                 timestep_scale_multiplier=1000.0)
_NAMES = (("proj_in.", "patchify_proj."), ("time_embed.", "adaln_single."), (".norm_q.", ".q_norm."),
          (".norm_k.", ".k_norm."))


def tiny_config(**size) -> dict:
    return sized("ltxv", LTXV_TINY, size)


def build_tiny_model(seed: int = 0, **size) -> torch.nn.Module:
    return random_model("LTXVideoTransformer3DModel", tiny_config(**size), seed)


def original_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """ComfyUI's names for every weight."""
    out = {}
    for key, value in model.state_dict().items():
        for ours, theirs in _NAMES:
            if key.startswith(ours) or ours.startswith("."):
                key = key.replace(ours, theirs)
        out[key] = value.detach()
    return out


def release_metadata(config) -> dict:
    """The release's `config` metadata of a model of this config (a mapping)."""
    transformer = {key: config[key] for key in ("num_attention_heads", "attention_head_dim",
                                                "causal_temporal_positioning", "timestep_scale_multiplier")}
    return {"config": json.dumps({"transformer": transformer})}


def write_tiny_checkpoint(path: str, layout: str = "original", dtype: str = "float32", seed: int = 0,
                          prefix: str = "", max_shard_size=None, **size) -> str:
    model = build_tiny_model(seed, **size)
    return save_tiny(model, path, layout, dtype, prefix, max_shard_size, original_state_dict,
                     metadata=release_metadata(model.config))
