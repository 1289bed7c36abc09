"""Tiny random-weight Lumina 2 models (diffusers' Lumina2Transformer2DModel: 6 query heads over 2 key / value heads
of size 24, 1 refiner block per stream, 2 main blocks) and their files in ComfyUI's key layout (fused
`attention.qkv`, `attention.out`, `q_norm` / `k_norm`, `cap_embedder`, `t_embedder.mlp`, `final_layer`, the
release's unused `norm_final`); written separately from the loader's key plan so that a round trip checks both.
Variant "newbie": NewBie's pooled-text modules (clip_text_pooled_proj, time_text_embed) of width NEWBIE_WIDTH added."""
from __future__ import annotations

import torch

from .weights import plain_tiny, randomize_

LUMINA2_TINY = dict(patch_size=2, in_channels=16, hidden_size=144, num_layers=2, num_refiner_layers=1,
                    num_attention_heads=6, num_kv_heads=2, multiple_of=256, ffn_dim_multiplier=None,
                    cap_feat_dim=32, axes_dim_rope=(8, 8, 8), axes_lens=(300, 512, 512))
_TOP = {"time_caption_embed.caption_embedder.": "cap_embedder.",
        "time_caption_embed.timestep_embedder.linear_1.": "t_embedder.mlp.0.",
        "time_caption_embed.timestep_embedder.linear_2.": "t_embedder.mlp.2.",
        "norm_out.linear_1.": "final_layer.adaLN_modulation.1.", "norm_out.linear_2.": "final_layer.linear."}
_BLOCK = {".attn.to_out.0.": ".attention.out.", ".attn.norm_q.": ".attention.q_norm.",
          ".attn.norm_k.": ".attention.k_norm.", ".norm1.linear.": ".adaLN_modulation.1.",
          ".norm1.norm.": ".attention_norm1.", ".norm1.": ".attention_norm1.", ".norm2.": ".attention_norm2.",
          ".feed_forward.linear_1.": ".feed_forward.w1.", ".feed_forward.linear_2.": ".feed_forward.w2.",
          ".feed_forward.linear_3.": ".feed_forward.w3."}


NEWBIE_WIDTH = 40  # the pooled CLIP text's width (1024 in the release)
tiny_config, _build_plain = plain_tiny("lumina2", "Lumina2Transformer2DModel", LUMINA2_TINY)


def build_tiny_model(seed: int = 0, variant: str = "", **size) -> torch.nn.Module:
    """The tiny Lumina 2; variant "newbie" with NewBie's modules (seeded apart from the base weights)."""
    model = _build_plain(seed, **size)
    if variant == "newbie":
        from sp_runtime.families.lumina2.newbie import add_newbie_modules
        extra = torch.nn.Module()
        add_newbie_modules(model, NEWBIE_WIDTH)
        extra.clip_text_pooled_proj, extra.time_text_embed = model.clip_text_pooled_proj, model.time_text_embed
        randomize_(extra, seed + 1000)
        model.requires_grad_(False)
    elif variant:
        raise ValueError(f"unknown variant {variant!r} for lumina2 (known: newbie)")
    return model


def original_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """ComfyUI's names: q, k, v rows stacked into attention.qkv, the renames above, plus the unused norm_final."""
    state = {key: value.detach() for key, value in model.state_dict().items()}
    out = {"norm_final.weight": torch.ones(model.config.hidden_size)}
    for key, value in state.items():
        if key.endswith(".attn.to_q.weight"):
            stem = key[:-len("attn.to_q.weight")]
            out[stem + "attention.qkv.weight"] = torch.cat([state[f"{stem}attn.to_{part}.weight"] for part in "qkv"])
        elif not key.endswith((".attn.to_k.weight", ".attn.to_v.weight")):
            out[_original_name(key)] = value
    return out


def _original_name(key: str) -> str:
    for ours, theirs in _TOP.items():
        if key.startswith(ours):
            return theirs + key[len(ours):]
    for ours, theirs in _BLOCK.items():
        if ours in key:
            key = key.replace(ours, theirs)
            if ours.startswith(".norm1"):  # norm1.norm / norm1.linear before the plain norm1 of context_refiner
                break
    return key
