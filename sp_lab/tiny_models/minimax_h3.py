"""Tiny random-weight MiniMax H3 models (diffusers' MiniMaxH3Transformer3DModel: 3 heads of 32 channels, 24 of them
rotated, a 48-wide residual stream, 2 blocks, 1 refiner block) and their files in ComfyUI's layout (`blocks.N`,
fused `attn.qkv_proj`, `mlp.fc1` as `[gate; value]`, `final_layer.*`, `rope.inv_freq`), full or pruned (the curve
form: `adaln_t_table` in place of the time embedder) or FastH3-like (a bank of output heads). The writer is the
inverse of the loader's key plan, written by hand, so that a round trip checks both."""
from __future__ import annotations

import torch

from .weights import randomize_, save_tiny

MINIMAX_TINY = dict(num_attention_heads=3, attention_head_dim=32, hidden_size=48, num_layers=2, num_refiner_layers=1,
                    ffn_dim=64, in_channels=4, audio_in_channels=6, text_dim=20, freq_dim=16,
                    time_embed_hidden_dim=24, time_embed_dim=12, rope_freq_dim=4)
CURVE = (33, 8)   # pruned files: adaln_t_table rows x width
VARIANTS = ("full", "pruned", "fast")
FAST_HEADS = 4
_TOP = (("transformer_blocks.", "blocks."), ("token_refiner.refiner_blocks.", "token_refiner.blocks."),
        ("time_embedder.linear_1.", "time_embedder.proj_in."), ("time_embedder.linear_2.", "time_embedder.proj_out."),
        ("audio_proj_in.", "audio_patch_proj."), ("proj_in.", "video_patch_proj."),
        ("context_embedder.", "condition_proj."), ("norm_out.norm.", "final_layer.norm."),
        ("norm_out.linear.", "final_layer.adaln_proj.linear."), ("audio_proj_out.", "final_layer.audio_out."),
        ("proj_out.", "final_layer.video_out."))
_INNER = ((".attn.norm_q.", ".attn.q_norm."), (".attn.norm_k.", ".attn.k_norm."), (".attn.to_out.0.", ".attn.out_proj."),
          (".ff.net.0.proj.", ".mlp.fc1."), (".ff.net.2.", ".mlp.fc2."))


def tiny_config(variant: str = "full", **size) -> dict:
    unknown = set(size) - set(MINIMAX_TINY)
    if unknown or variant not in VARIANTS:
        raise ValueError(f"unknown size options {sorted(unknown)} or variant {variant!r} for minimax_h3; known: "
                         f"{sorted(MINIMAX_TINY)}, variants {VARIANTS}")
    config = {**MINIMAX_TINY, **size}
    if variant != "full":
        config.update(time_embed_dim=CURVE[1], time_embed_hidden_dim=CURVE[1])
    return config


def build_tiny_model(seed: int = 0, variant: str = "full", **size) -> torch.nn.Module:
    """The float32 model; pruned / fast: with the curve time embedder (and fast: a bank of FAST_HEADS output heads),
    as the loader builds them."""
    from diffusers import MiniMaxH3Transformer3DModel
    from sp_runtime.families.minimax_h3.loading import CurveTime
    config = tiny_config(variant, **size)
    model = MiniMaxH3Transformer3DModel.from_config(config)
    if variant != "full":
        model.time_proj, model.time_embedder = torch.nn.Identity(), CurveTime(*CURVE)
    if variant == "fast":
        model.proj_out = torch.nn.Linear(config["hidden_size"], FAST_HEADS * model.proj_out.out_features)
        model.audio_proj_out = torch.nn.Linear(config["hidden_size"], FAST_HEADS * config["audio_in_channels"])
    randomize_(model, seed)
    return model.eval().requires_grad_(False)


def original_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """ComfyUI's names: q, k, v fused, SwiGLU rows back to [gate; value], the curve table as adaln_t_table."""
    out = {}
    for key, value in model.state_dict().items():
        value = value.detach()
        if key == "time_embedder.table":
            out["adaln_t_table"] = value
            continue
        if ".attn.to_k." in key or ".attn.to_v." in key:
            continue
        if ".attn.to_q." in key:
            value = torch.cat([model.state_dict()[key.replace("to_q", name)] for name in ("to_q", "to_k", "to_v")])
            key = key.replace(".attn.to_q.", ".attn.qkv_proj.")
        if ".ff.net.0.proj." in key:
            value = torch.cat(value.chunk(2)[::-1])
        ours = next(((new, old) for new, old in _TOP if key.startswith(new)), None)
        key = key if ours is None else ours[1] + key[len(ours[0]):]
        for new, old in _INNER:
            key = key.replace(new, old)
        out[key] = value
    out["rope.inv_freq"] = model.rope.inv_freq.detach()
    return out


def write_tiny_checkpoint(path: str, layout: str = "original", dtype: str = "float32", seed: int = 0,
                          prefix: str = "", max_shard_size=None, variant: str = "full", **size) -> str:
    if layout != "original":
        raise ValueError("MiniMax H3 files are written in ComfyUI's layout only (its released format)")
    return save_tiny(build_tiny_model(seed, variant, **size), path, layout, dtype, prefix, max_shard_size,
                     original_state_dict)
