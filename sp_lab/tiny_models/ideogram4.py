"""Tiny random-weight Ideogram 4 models (diffusers' Ideogram4Transformer2DModel: 3 heads of 64 channels, MRoPE
sections (6, 5, 5), 2 blocks, 40 text features) and their files in ComfyUI's key layout (fused `attention.qkv`,
`attention.o`); written separately from the loader's key plan so that a round trip checks both."""
from __future__ import annotations

import torch

from .weights import random_model, sized

IDEOGRAM4_TINY = dict(in_channels=16, num_layers=2, attention_head_dim=64, num_attention_heads=3,
                      intermediate_size=96, adaln_dim=24, llm_features_dim=40, rope_theta=5_000_000,
                      mrope_section=(6, 5, 5), norm_eps=1e-5)


def tiny_config(**size) -> dict:
    config = sized("ideogram4", IDEOGRAM4_TINY, size)
    if "attention_head_dim" in size and "mrope_section" not in size:  # the released sections scaled, as detection
        config["mrope_section"] = tuple(part * config["attention_head_dim"] // 256 for part in (24, 20, 20))
    return config


def build_tiny_model(seed: int = 0, **size) -> torch.nn.Module:
    return random_model("Ideogram4Transformer2DModel", tiny_config(**size), seed)


def original_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """ComfyUI's names: q, k, v rows stacked into attention.qkv, to_out.0 as attention.o."""
    state = {key: value.detach() for key, value in model.state_dict().items()}
    out = {}
    for key, value in state.items():
        if key.endswith(".attention.to_q.weight"):
            stem = key[:-len("to_q.weight")]
            out[stem + "qkv.weight"] = torch.cat([state[f"{stem}to_{part}.weight"] for part in "qkv"])
        elif not key.endswith((".attention.to_k.weight", ".attention.to_v.weight")):
            out[key.replace(".attention.to_out.0.", ".attention.o.")] = value
    return out
