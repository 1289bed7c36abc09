"""Tiny random-weight SD3.5 models (diffusers' SD3Transformer2DModel at ComfyUI's head size 64: 3 heads, 3 joint
blocks, a 12x12 positional table) and their files in ComfyUI's MMDiT key layout (`joint_blocks.N.x_block` /
`context_block`, fused `attn.qkv`, `ln_q` / `ln_k`, `(shift, scale)` final modulation), as diffusers single files and
as diffusers folders. The ComfyUI writer is the inverse of the loader's key plan, written by hand (the plan comes
from diffusers' converter), so that a round trip checks both."""
from __future__ import annotations

import torch

from .weights import random_model, sized

SD3_TINY = dict(sample_size=12, patch_size=2, in_channels=16, out_channels=16, num_layers=3, attention_head_dim=64,
                num_attention_heads=3, joint_attention_dim=32, caption_projection_dim=192, pooled_projection_dim=24,
                pos_embed_max_size=12, dual_attention_layers=(0,), qk_norm="rms_norm")
VARIANTS = {"3.5_medium": {}, "3.5_large": dict(dual_attention_layers=()),
            "3_medium": dict(dual_attention_layers=(), qk_norm=None)}
_TOP = {"pos_embed.proj": "x_embedder.proj", "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
        "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2", "context_embedder": "context_embedder",
        "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
        "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2", "proj_out": "final_layer.linear"}
_BLOCK = {"norm1.linear": "x_block.adaLN_modulation.1", "norm1_context.linear": "context_block.adaLN_modulation.1",
          "attn.to_out.0": "x_block.attn.proj", "attn.to_add_out": "context_block.attn.proj",
          "attn2.to_out.0": "x_block.attn2.proj", "ff.net.0.proj": "x_block.mlp.fc1", "ff.net.2": "x_block.mlp.fc2",
          "ff_context.net.0.proj": "context_block.mlp.fc1", "ff_context.net.2": "context_block.mlp.fc2",
          "attn.norm_q": "x_block.attn.ln_q", "attn.norm_k": "x_block.attn.ln_k",
          "attn.norm_added_q": "context_block.attn.ln_q", "attn.norm_added_k": "context_block.attn.ln_k",
          "attn2.norm_q": "x_block.attn2.ln_q", "attn2.norm_k": "x_block.attn2.ln_k"}
_FUSED = {"x_block.attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
          "context_block.attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
          "x_block.attn2.qkv": ("attn2.to_q", "attn2.to_k", "attn2.to_v")}


def tiny_config(variant: str = "3.5_medium", **size) -> dict:
    return sized("sd3", {**SD3_TINY, **VARIANTS[variant]}, size)


def build_tiny_model(seed: int = 0, variant: str = "3.5_medium", **size) -> torch.nn.Module:
    return random_model("SD3Transformer2DModel", tiny_config(variant, **size), seed)


def _swapped(tensor: torch.Tensor) -> torch.Tensor:
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first])


def original_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """ComfyUI's MMDiT names: fused q, k, v; (shift, scale) order where diffusers keeps (scale, shift) (the final
    layer's and the last block's text-side modulation)."""
    state = {key: value.detach() for key, value in model.state_dict().items()}
    last = model.config.num_layers - 1
    out = {"pos_embed": state["pos_embed.pos_embed"]}
    for kind in ("weight", "bias"):
        for ours, theirs in _TOP.items():
            out[f"{theirs}.{kind}"] = state[f"{ours}.{kind}"]
        out[f"final_layer.adaLN_modulation.1.{kind}"] = _swapped(state[f"norm_out.linear.{kind}"])
    for i in range(model.config.num_layers):
        for kind in ("weight", "bias"):
            for theirs, parts in _FUSED.items():
                if f"transformer_blocks.{i}.{parts[0]}.{kind}" in state:
                    out[f"joint_blocks.{i}.{theirs}.{kind}"] = torch.cat(
                        [state[f"transformer_blocks.{i}.{part}.{kind}"] for part in parts])
            for ours, theirs in _BLOCK.items():
                if f"transformer_blocks.{i}.{ours}.{kind}" in state:
                    out[f"joint_blocks.{i}.{theirs}.{kind}"] = state[f"transformer_blocks.{i}.{ours}.{kind}"]
        if i == last:
            name = f"joint_blocks.{i}.context_block.adaLN_modulation.1"
            for kind in ("weight", "bias"):
                out[f"{name}.{kind}"] = _swapped(out[f"{name}.{kind}"])
    return out
