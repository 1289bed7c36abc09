"""Tiny random-weight HunyuanVideo 1.0 and 1.5 models (diffusers' HunyuanVideoTransformer3DModel and
HunyuanVideo15Transformer3DModel: the real head size 128, 3 heads, 1 + 1 (1.5: 2) blocks, 1 refiner block, MLP
ratio 2, small text widths) and their files in
Tencent's key layout (as Tencent's releases and Comfy-Org's repackaged files name them), with or without
`model.diffusion_model.`, and as diffusers files. The package's API dispatches here.

1.0 variants: t2v (16 channels), i2v (33: noise + image latent + mask), skyreels_i2v (32), t2v without guidance
embedding ("no_guidance"). 1.5: 65 -> 32 channels as released, ByT5 and SigLIP projections of small widths; "sr":
the 1080p super-resolution model (98 input channels, meanflow's second timestep embedder);
qkv="split" writes q, k and v apart as Tencent's 1.5 release does ("fused" as Comfy-Org's repackaged files). The
Tencent-layout writer is the inverse of the loader's key plan, written separately so a round trip checks both.
"""
from __future__ import annotations

import torch

from .weights import randomize_, save_tiny

HV_TINY = dict(in_channels=16, out_channels=16, num_attention_heads=3, attention_head_dim=128, num_layers=1,
               num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
               guidance_embeds=True, text_embed_dim=32, pooled_projection_dim=24, rope_axes_dim=(16, 56, 56))
HV15_TINY = dict(in_channels=65, out_channels=32, num_attention_heads=3, attention_head_dim=128, num_layers=2,
                 num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=32,
                 text_embed_2_dim=48,
                 image_embed_dim=40, rope_axes_dim=(16, 56, 56))
HV_VARIANTS = {"t2v": {}, "i2v": dict(in_channels=33), "skyreels_i2v": dict(in_channels=32),
               "no_guidance": dict(guidance_embeds=False)}
HV15_VARIANTS = {"t2v": {}, "sr": dict(in_channels=98, use_meanflow=True)}  # sr: the 1080p super-resolution model

_TOP = {"x_embedder.proj": "img_in.proj",
        "context_embedder.proj_in": "txt_in.input_embedder",
        "context_embedder.time_text_embed.timestep_embedder.linear_1": "txt_in.t_embedder.mlp.0",
        "context_embedder.time_text_embed.timestep_embedder.linear_2": "txt_in.t_embedder.mlp.2",
        "context_embedder.time_text_embed.text_embedder.linear_1": "txt_in.c_embedder.linear_1",
        "context_embedder.time_text_embed.text_embedder.linear_2": "txt_in.c_embedder.linear_2",
        "proj_out": "final_layer.linear"}
_TOP_10 = {"time_text_embed.timestep_embedder.linear_1": "time_in.mlp.0",
           "time_text_embed.timestep_embedder.linear_2": "time_in.mlp.2",
           "time_text_embed.guidance_embedder.linear_1": "guidance_in.mlp.0",
           "time_text_embed.guidance_embedder.linear_2": "guidance_in.mlp.2",
           "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
           "time_text_embed.text_embedder.linear_2": "vector_in.out_layer"}
_TOP_15 = {"time_embed.timestep_embedder.linear_1": "time_in.mlp.0",
           "time_embed.timestep_embedder.linear_2": "time_in.mlp.2",
           "time_embed.timestep_embedder_r.linear_1": "time_r_in.mlp.0",
           "time_embed.timestep_embedder_r.linear_2": "time_r_in.mlp.2",
           "context_embedder_2.norm": "byt5_in.layernorm", "context_embedder_2.linear_1": "byt5_in.fc1",
           "context_embedder_2.linear_2": "byt5_in.fc2", "context_embedder_2.linear_3": "byt5_in.fc3",
           "image_embedder.norm_in": "vision_in.proj.0", "image_embedder.linear_1": "vision_in.proj.1",
           "image_embedder.linear_2": "vision_in.proj.3", "image_embedder.norm_out": "vision_in.proj.4",
           "cond_type_embed": "cond_type_embedding"}
_REFINER = {"norm1": "norm1", "norm2": "norm2", "attn.to_out.0": "self_attn_proj", "ff.net.0.proj": "mlp.fc1",
            "ff.net.2": "mlp.fc2", "norm_out.linear": "adaLN_modulation.1"}
_DOUBLE = {"norm1.linear": "img_mod.linear", "norm1_context.linear": "txt_mod.linear",
           "attn.norm_q": "img_attn_q_norm", "attn.norm_k": "img_attn_k_norm",
           "attn.norm_added_q": "txt_attn_q_norm", "attn.norm_added_k": "txt_attn_k_norm",
           "attn.to_out.0": "img_attn_proj", "attn.to_add_out": "txt_attn_proj",
           "ff.net.0.proj": "img_mlp.fc1", "ff.net.2": "img_mlp.fc2",
           "ff_context.net.0.proj": "txt_mlp.fc1", "ff_context.net.2": "txt_mlp.fc2"}
_SINGLE = {"norm.linear": "modulation.linear", "proj_out": "linear2", "attn.norm_q": "q_norm",
           "attn.norm_k": "k_norm"}


def tiny_config(version: str = "1.0", variant: str = "t2v", **size) -> dict:
    """diffusers config of a tiny HunyuanVideo ("1.0" or "1.5"); `size` overrides any key."""
    if version == "1.5" and variant in HV15_VARIANTS:
        config = dict(HV15_TINY, **HV15_VARIANTS[variant])
    elif version != "1.5" and variant in HV_VARIANTS:
        config = dict(HV_TINY, **HV_VARIANTS[variant])
    else:
        known = sorted(HV15_VARIANTS if version == "1.5" else HV_VARIANTS)
        raise ValueError(f"unknown HunyuanVideo {version} variant {variant!r}; tiny models exist for {known}")
    unknown = set(size) - set(config) - {"image_condition_type"}
    if unknown:
        raise ValueError(f"unknown size options {sorted(unknown)} for HunyuanVideo {version}; known: {sorted(config)}")
    return {**config, **size}


def build_tiny_model(seed: int = 0, version: str = "1.0", variant: str = "t2v", **size) -> torch.nn.Module:
    """A float32 diffusers HunyuanVideo (1.0 or 1.5) with seeded random weights (stock attention processors)."""
    from diffusers import HunyuanVideo15Transformer3DModel, HunyuanVideoTransformer3DModel
    cls = HunyuanVideo15Transformer3DModel if version == "1.5" else HunyuanVideoTransformer3DModel
    model = cls.from_config(tiny_config(version, variant, **size))
    randomize_(model, seed)
    return model.eval().requires_grad_(False)


def tencent_state_dict(model: torch.nn.Module, qkv: str = "fused") -> dict[str, torch.Tensor]:
    """The model's weights under Tencent's key names (qkv "fused": img_attn_qkv ...; "split": img_attn_q ...)."""
    state = {key: value.detach() for key, value in model.state_dict().items()}
    top = {**_TOP, **(_TOP_15 if "cond_type_embed.weight" in state else _TOP_10)}
    out = {}
    for ours, theirs in top.items():
        for kind in ("weight", "bias"):
            if f"{ours}.{kind}" in state:
                out[f"{theirs}.{kind}"] = state[f"{ours}.{kind}"]
    for kind in ("weight", "bias"):  # diffusers keeps (scale, shift), Tencent (shift, scale)
        scale, shift = state[f"norm_out.linear.{kind}"].chunk(2)
        out[f"final_layer.adaLN_modulation.1.{kind}"] = torch.cat([shift, scale])
    for i in range(model.config.num_refiner_layers):
        _rename_block(state, out, f"context_embedder.token_refiner.refiner_blocks.{i}.",
                      f"txt_in.individual_token_refiner.blocks.{i}.", _REFINER)
        _fuse(state, out, f"context_embedder.token_refiner.refiner_blocks.{i}.attn.to_",
              f"txt_in.individual_token_refiner.blocks.{i}.self_attn_qkv", "fused")
    for i in range(model.config.num_layers):
        ours, theirs = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        _rename_block(state, out, ours, theirs, _DOUBLE)
        _fuse(state, out, f"{ours}attn.to_", f"{theirs}img_attn_qkv", qkv)
        _fuse(state, out, f"{ours}attn.add_", f"{theirs}txt_attn_qkv", qkv, suffix="_proj")
    for i in range(getattr(model.config, "num_single_layers", 0)):
        ours, theirs = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        _rename_block(state, out, ours, theirs, _SINGLE)
        for kind in ("weight", "bias"):
            parts = [state[f"{ours}attn.to_{p}.{kind}"] for p in "qkv"] + [state[f"{ours}proj_mlp.{kind}"]]
            out[f"{theirs}linear1.{kind}"] = torch.cat(parts)
    return out


def _rename_block(state: dict, out: dict, ours: str, theirs: str, names: dict) -> None:
    for a, b in names.items():
        for kind in ("weight", "bias"):
            if f"{ours}{a}.{kind}" in state:
                out[f"{theirs}{b}.{kind}"] = state[f"{ours}{a}.{kind}"]


def _fuse(state: dict, out: dict, ours: str, theirs: str, qkv: str, suffix: str = "") -> None:
    """q, k, v of `ours` + "q" / "k" / "v" + suffix as one fused tensor (qkv "fused") or Tencent 1.5's three."""
    for kind in ("weight", "bias"):
        parts = [state[f"{ours}{p}{suffix}.{kind}"] for p in "qkv"]
        if qkv == "fused":
            out[f"{theirs}.{kind}"] = torch.cat(parts)
        else:
            for p, part in zip("qkv", parts):
                out[f"{theirs.removesuffix('qkv')}{p}.{kind}"] = part


def write_tiny_checkpoint(path: str, layout: str = "original", dtype: str = "float32", seed: int = 0,
                          prefix: str = "", variant: str = "", version: str = "1.0", qkv: str = "fused",
                          **size) -> str:
    """Build a tiny HunyuanVideo and save it: layout "original" (Tencent names), "diffusers" (one file) or
    "diffusers_folder"."""
    return save_tiny(build_tiny_model(seed, version, variant or "t2v", **size), path, layout, dtype, prefix,
                     original=lambda model: tencent_state_dict(model, qkv))
