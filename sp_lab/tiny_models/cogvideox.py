"""Tiny random-weight CogVideoX 1.5 models (diffusers' CogVideoXTransformer3DModel: 6 heads of size 16, 2 blocks,
48 input channels as VOID's inpainting passes take them, a 32-wide T5 stand-in, 2 x 2 x 2 patches, rotary) and
their files in ComfyUI's key layout (`blocks.N.q` / `attn_out` / `ff_proj`, flat `time_embedding_linear_1`);
written separately from the loader's key plan so that a round trip checks both."""
from __future__ import annotations

import torch

from .weights import random_model, sized

COGVIDEOX_TINY = dict(num_attention_heads=6, attention_head_dim=16, in_channels=48, out_channels=16,
                      time_embed_dim=32, text_embed_dim=32, num_layers=2, patch_size=2, patch_size_t=2,
                      use_rotary_positional_embeddings=True, ofs_embed_dim=None)
_TOP = (("time_embedding.linear_", "time_embedding_linear_"), ("ofs_embedding.linear_", "ofs_embedding_linear_"),
        ("transformer_blocks.", "blocks."))
_INNER = ((".attn1.to_q.", ".q."), (".attn1.to_k.", ".k."), (".attn1.to_v.", ".v."), (".attn1.norm_q.", ".norm_q."),
          (".attn1.norm_k.", ".norm_k."), (".attn1.to_out.0.", ".attn_out."), (".ff.net.0.proj.", ".ff_proj."),
          (".ff.net.2.", ".ff_out."))


def tiny_config(**size) -> dict:
    return sized("cogvideox", COGVIDEOX_TINY, size)


def build_tiny_model(seed: int = 0, **size) -> torch.nn.Module:
    return random_model("CogVideoXTransformer3DModel", tiny_config(**size), seed)


def original_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """ComfyUI's names for every weight."""
    out = {}
    for key, value in model.state_dict().items():
        for ours, theirs in _TOP:
            if key.startswith(ours):
                key = theirs + key[len(ours):]
        for ours, theirs in _INNER:
            key = key.replace(ours, theirs)
        out[key] = value.detach()
    return out
