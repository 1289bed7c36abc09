"""Flux.1's key plan: original (BFL / ComfyUI) names -> diffusers' parameters, one source tensor at a time.

`flux_key_plan` is our own width-aware version of diffusers' `convert_flux_transformer_checkpoint_to_diffusers`,
which hardcodes the full-size width (3072) and needs the whole state dict in memory at once (that would stop us
casting each tensor to its final dtype as it is read: fp8 storage from a bf16 file would peak at the bf16 size).
tests/families/test_flux.py checks that both produce the same tensors on a full-size checkpoint.
"""
from __future__ import annotations

from typing import Iterable

from ...checkpoints.loading import KeyPlan, Transform, original_layout_plan, row_split, swap_halves
from .detection import MLP_RATIO


_TOP = {
    "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
    "txt_in": "context_embedder",
    "img_in": "x_embedder",
    "final_layer.linear": "proj_out",
}
# Block module names (original -> diffusers) Flux.1's and HunyuanVideo's files share
DOUBLE_BLOCK = {
    "img_mod.lin": "norm1.linear", "txt_mod.lin": "norm1_context.linear",
    "img_attn.proj": "attn.to_out.0", "txt_attn.proj": "attn.to_add_out",
    "img_mlp.0": "ff.net.0.proj", "img_mlp.2": "ff.net.2", "txt_mlp.0": "ff_context.net.0.proj",
    "txt_mlp.2": "ff_context.net.2",
    "img_attn.norm.query_norm": "attn.norm_q", "img_attn.norm.key_norm": "attn.norm_k",
    "txt_attn.norm.query_norm": "attn.norm_added_q", "txt_attn.norm.key_norm": "attn.norm_added_k",
}
DOUBLE_FUSED = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
                "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
SINGLE_BLOCK = {"modulation.lin": "norm.linear", "linear2": "proj_out",
                "norm.query_norm": "attn.norm_q", "norm.key_norm": "attn.norm_k"}
SINGLE_FUSED = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")


def original_plan(keys: Iterable[str], config) -> KeyPlan:
    """Original (BFL / ComfyUI) key names -> parameters of the model of `config` (LoRAs use these names too)."""
    return flux_key_plan(keys, config["num_attention_heads"] * config["attention_head_dim"])


weight_plan = original_layout_plan(original_plan)


def flux_key_plan(keys: Iterable[str], hidden: int) -> dict[str, list[tuple[str, Transform]]]:
    """Original-layout key (no prefix) -> [(diffusers key, transform)] for every key of a Flux.1 checkpoint.

    Keys it does not know are left out (load_weights reports them).
    """
    plan = {}
    for key in keys:
        module, _, kind = key.rpartition(".")  # marker tensors without a dot (scaled_fp8) map to nothing
        kind = "weight" if kind == "scale" else kind
        targets = _convert(module, kind, hidden)
        if targets:
            plan[key] = targets
    return plan


def _convert(module: str, kind: str, hidden: int) -> list[tuple[str, Transform]]:
    if module in _TOP:
        return [(f"{_TOP[module]}.{kind}", None)]
    if module == "final_layer.adaLN_modulation.1":  # (shift, scale) -> diffusers' (scale, shift)
        return [(f"norm_out.linear.{kind}", swap_halves)]
    stem, _, rest = module.partition(".")
    index, _, inner = rest.partition(".")
    if not index.isdigit():
        return []
    if stem == "double_blocks":
        prefix = f"transformer_blocks.{index}."
        if inner in DOUBLE_BLOCK:
            return [(f"{prefix}{DOUBLE_BLOCK[inner]}.{kind}", None)]
        if inner in DOUBLE_FUSED:
            return row_split(prefix, DOUBLE_FUSED[inner], kind, (hidden,) * 3)
    if stem == "single_blocks":
        prefix = f"single_transformer_blocks.{index}."
        if inner in SINGLE_BLOCK:
            return [(f"{prefix}{SINGLE_BLOCK[inner]}.{kind}", None)]
        if inner == "linear1":
            return row_split(prefix, SINGLE_FUSED, kind, (hidden,) * 3 + (MLP_RATIO * hidden,))
    return []
