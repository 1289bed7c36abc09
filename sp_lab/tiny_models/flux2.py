"""Tiny random-weight Flux.2 models (diffusers' Flux2Transformer2DModel: real head size 128, 3 heads, 1 double and 2
single blocks, 16 latent channels) and their files in the original (BFL / ComfyUI) key layout, as diffusers single
files and as diffusers folders. Variant "klein": no guidance embedding. The package's API dispatches here; the
original-layout writer is the inverse of diffusers' converter, written separately so that a round trip checks both."""
from __future__ import annotations

import torch

from .weights import random_model, sized

FLUX2_TINY = dict(patch_size=1, in_channels=16, out_channels=None, num_layers=1, num_single_layers=2,
                  attention_head_dim=128, num_attention_heads=3, joint_attention_dim=32, mlp_ratio=3.0,
                  axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, guidance_embeds=True,
                  timestep_guidance_channels=256)
_TOP = {"x_embedder": "img_in", "context_embedder": "txt_in", "proj_out": "final_layer.linear",
        "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
        "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
        "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
        "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
        "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
        "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
        "single_stream_modulation.linear": "single_stream_modulation.lin"}
_DOUBLE = {"attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj", "ff.linear_in": "img_mlp.0",
           "ff.linear_out": "img_mlp.2", "ff_context.linear_in": "txt_mlp.0", "ff_context.linear_out": "txt_mlp.2"}
_DOUBLE_NORMS = {"attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
                 "attn.norm_added_q": "txt_attn.norm.query_norm", "attn.norm_added_k": "txt_attn.norm.key_norm"}
_SINGLE = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2"}
_SINGLE_NORMS = {"attn.norm_q": "norm.query_norm", "attn.norm_k": "norm.key_norm"}


def tiny_config(variant: str = "", **size) -> dict:
    return sized("flux2", dict(FLUX2_TINY, guidance_embeds=variant != "klein"), size)


def build_tiny_model(seed: int = 0, variant: str = "", **size) -> torch.nn.Module:
    return random_model("Flux2Transformer2DModel", tiny_config(variant, **size), seed)


def original_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = {key: value.detach() for key, value in model.state_dict().items()}
    out = {f"{theirs}.weight": state[f"{ours}.weight"] for ours, theirs in _TOP.items() if f"{ours}.weight" in state}
    scale, shift = state["norm_out.linear.weight"].chunk(2)  # diffusers keeps (scale, shift), the original (shift,
    out["final_layer.adaLN_modulation.1.weight"] = torch.cat([shift, scale])  # scale)
    for i in range(model.config.num_layers):
        ours, theirs = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        out.update({f"{theirs}{b}.weight": state[f"{ours}{a}.weight"] for a, b in _DOUBLE.items()})
        out.update({f"{theirs}{b}.scale": state[f"{ours}{a}.weight"] for a, b in _DOUBLE_NORMS.items()})
        out[f"{theirs}img_attn.qkv.weight"] = torch.cat([state[f"{ours}attn.to_{p}.weight"] for p in "qkv"])
        out[f"{theirs}txt_attn.qkv.weight"] = torch.cat([state[f"{ours}attn.add_{p}_proj.weight"] for p in "qkv"])
    for i in range(model.config.num_single_layers):
        ours, theirs = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        out.update({f"{theirs}{b}.weight": state[f"{ours}{a}.weight"] for a, b in _SINGLE.items()})
        out.update({f"{theirs}{b}.scale": state[f"{ours}{a}.weight"] for a, b in _SINGLE_NORMS.items()})
    return out
