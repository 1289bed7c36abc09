"""Tiny random-weight Krea 2 models (diffusers' Krea2Transformer2DModel at ComfyUI's fixed head sizes: 5 query heads
of 128 over 1 key / value head, 2 blocks; a 3-layer text stack of 160 wide with ComfyUI's 20 text heads; SwiGLU
sizes as ComfyUI's rounding gives them) and their files in ComfyUI's key layout (`first`, `tmlp`, `tproj`,
`txtfusion`, `txtmlp`, `blocks.N.attn.wq`, flat `mod.lin`, `last`); written separately from the loader's key plan
so that a round trip checks both."""
from __future__ import annotations

import torch

from .weights import random_model, sized

KREA2_TINY = dict(in_channels=64, num_layers=2, attention_head_dim=128, num_attention_heads=5, num_key_value_heads=1,
                  intermediate_size=1792, timestep_embed_dim=256, text_hidden_dim=160, num_text_layers=3,
                  text_num_attention_heads=20, text_num_key_value_heads=20, text_intermediate_size=512,
                  num_layerwise_text_blocks=2, num_refiner_text_blocks=2, axes_dims_rope=(32, 48, 48),
                  rope_theta=1000.0)
_TOP = (("img_in.", "first."), ("time_embed.linear_1.", "tmlp.0."), ("time_embed.linear_2.", "tmlp.2."),
        ("time_mod_proj.", "tproj.1."), ("txt_in.norm.weight", "txtmlp.0.scale"), ("txt_in.linear_1.", "txtmlp.1."),
        ("txt_in.linear_2.", "txtmlp.3."), ("text_fusion.", "txtfusion."), ("transformer_blocks.", "blocks."),
        ("final_layer.linear.", "last.linear."), ("final_layer.norm.weight", "last.norm.scale"),
        ("final_layer.scale_shift_table", "last.modulation.lin"))
_INNER = ((".attn.to_q.", ".attn.wq."), (".attn.to_k.", ".attn.wk."), (".attn.to_v.", ".attn.wv."),
          (".attn.to_out.0.", ".attn.wo."), (".attn.to_gate.", ".attn.gate."),
          (".attn.norm_q.weight", ".attn.qknorm.qnorm.scale"), (".attn.norm_k.weight", ".attn.qknorm.knorm.scale"),
          (".ff.", ".mlp."), (".norm1.weight", ".prenorm.scale"), (".norm2.weight", ".postnorm.scale"),
          (".scale_shift_table", ".mod.lin"))


def tiny_config(**size) -> dict:
    return sized("krea2", KREA2_TINY, size)


def build_tiny_model(seed: int = 0, **size) -> torch.nn.Module:
    return random_model("Krea2Transformer2DModel", tiny_config(**size), seed)


def original_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """ComfyUI's names (each block's modulation table flat, as the release stores it)."""
    out = {}
    for key, value in model.state_dict().items():
        name = key
        for ours, theirs in _TOP:
            if name.startswith(ours):
                name = theirs + name[len(ours):]
                break
        if name.startswith("blocks.") or name.startswith("txtfusion."):
            for ours, theirs in _INNER:
                name = name.replace(ours, theirs)
        out[name] = value.detach().flatten() if name.endswith(".mod.lin") else value.detach()
    return out
