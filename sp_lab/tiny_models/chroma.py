"""Tiny random-weight Chroma models (diffusers' ChromaTransformer2DModel: 6 heads of 16, 2 double + 2 single blocks,
a 2-layer guidance network of width 48) and their files in ComfyUI's key layout (Flux's `double_blocks` /
`single_blocks` without modulation, fused qkv and `linear1`, `distilled_guidance_layer` with `in_layer` /
`out_layer` / `norms.N.scale`), as diffusers single files and folders. Written by hand, apart from the loader's key
plan, so that a round trip checks both."""
from __future__ import annotations

import torch

from .weights import plain_tiny

CHROMA_TINY = dict(patch_size=1, in_channels=64, out_channels=None, num_layers=2, num_single_layers=2,
                   attention_head_dim=16, num_attention_heads=6, joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
                   approximator_num_channels=64, approximator_hidden_dim=48, approximator_layers=2)
_RENAMES = (("x_embedder.", "img_in."), ("context_embedder.", "txt_in."), ("proj_out.", "final_layer.linear."),
            (".linear_1.", ".in_layer."), (".linear_2.", ".out_layer."))
_DOUBLE = {"attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj", "ff.net.0.proj": "img_mlp.0",
           "ff.net.2": "img_mlp.2", "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2",
           "attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
           "attn.norm_added_q": "txt_attn.norm.query_norm", "attn.norm_added_k": "txt_attn.norm.key_norm"}
_SINGLE = {"proj_out": "linear2", "attn.norm_q": "norm.query_norm", "attn.norm_k": "norm.key_norm"}


tiny_config, build_tiny_model = plain_tiny("chroma", "ChromaTransformer2DModel", CHROMA_TINY)


def original_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = {key: value.detach() for key, value in model.state_dict().items()}
    out = {}
    for key, value in state.items():
        stem, index, rest = (key.split(".", 2) + ["", ""])[:3]
        if stem in ("transformer_blocks", "single_transformer_blocks"):
            out.update(_block(stem, index, rest, state))
        else:
            for ours, theirs in _RENAMES:
                key = key.replace(ours, theirs)
            out[key[:-len("weight")] + "scale" if ".norms." in key else key] = value
    return out


def _block(stem: str, index: str, rest: str, state: dict) -> dict:
    module, _, kind = rest.rpartition(".")
    ours = f"{stem}.{index}."
    name = "double_blocks" if stem == "transformer_blocks" else "single_blocks"
    theirs = f"{name}.{index}."
    table = _DOUBLE if name == "double_blocks" else _SINGLE
    kind_out = "scale" if "norm" in module else kind
    if module in table:
        return {f"{theirs}{table[module]}.{kind_out}": state[ours + rest]}
    if name == "double_blocks" and module in ("attn.to_q", "attn.add_q_proj"):
        parts = ("to_q", "to_k", "to_v") if module == "attn.to_q" else ("add_q_proj", "add_k_proj", "add_v_proj")
        fused = "img_attn.qkv" if module == "attn.to_q" else "txt_attn.qkv"
        return {f"{theirs}{fused}.{kind}": torch.cat([state[f"{ours}attn.{p}.{kind}"] for p in parts])}
    if name == "single_blocks" and module == "attn.to_q":
        parts = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")
        return {f"{theirs}linear1.{kind}": torch.cat([state[f"{ours}{p}.{kind}"] for p in parts])}
    return {}
