"""Wan's key plan: original (Wan / ComfyUI) key names -> diffusers' WanTransformer3DModel names, per tensor (our
version of diffusers' convert_wan_transformer_to_diffusers, which tests/families/test_wan.py checks it against; it also maps
img_emb.emb_pos, which that converter leaves out). Variants add their names through the registry."""
from __future__ import annotations

from typing import Optional

from ...checkpoints.loading import KeyPlan
from .variants import REGISTRY

_TOP = {
    "patch_embedding": "patch_embedding",
    "vace_patch_embedding": "vace_patch_embedding",
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
    "time_projection.1": "condition_embedder.time_proj",
    "head.head": "proj_out",
    "img_emb.proj.0": "condition_embedder.image_embedder.norm1",
    "img_emb.proj.1": "condition_embedder.image_embedder.ff.net.0.proj",
    "img_emb.proj.3": "condition_embedder.image_embedder.ff.net.2",
    "img_emb.proj.4": "condition_embedder.image_embedder.norm2",
}
_TOP_PARAMETERS = {"head.modulation": "scale_shift_table",
                   "img_emb.emb_pos": "condition_embedder.image_embedder.pos_embed"}
_BLOCK = {
    "self_attn.q": "attn1.to_q", "self_attn.k": "attn1.to_k", "self_attn.v": "attn1.to_v",
    "self_attn.o": "attn1.to_out.0", "self_attn.norm_q": "attn1.norm_q", "self_attn.norm_k": "attn1.norm_k",
    "cross_attn.q": "attn2.to_q", "cross_attn.k": "attn2.to_k", "cross_attn.v": "attn2.to_v",
    "cross_attn.o": "attn2.to_out.0", "cross_attn.norm_q": "attn2.norm_q", "cross_attn.norm_k": "attn2.norm_k",
    "cross_attn.k_img": "attn2.add_k_proj", "cross_attn.v_img": "attn2.add_v_proj",
    "cross_attn.norm_k_img": "attn2.norm_added_k",
    "norm3": "norm2",  # the original's norm3 is the (affine) cross-attention norm; its norm2 has no weights
    "ffn.0": "ffn.net.0.proj", "ffn.2": "ffn.net.2",
    "before_proj": "proj_in", "after_proj": "proj_out",  # VACE blocks: hint in (block 0 only) and hint out
}
_BLOCK_PARAMETERS = {"modulation": "scale_shift_table"}


def wan_key_plan(keys) -> KeyPlan:
    """Original-layout key (prefix stripped) -> [(diffusers key, transform)]; keys it does not know are left out."""
    plan = {}
    for key in keys:
        mapper = next((v.key_targets for v in REGISTRY if v.key_targets and key.startswith(v.mapped_keys)), None)
        if mapper is not None:
            targets = mapper(key)
        else:
            target = _convert(original_key(key))
            targets = None if target is None else [(target, None)]
        if targets is not None:
            plan[key] = targets
    return plan


def original_key(key: str) -> str:
    """A key under its original name (variants with layouts of their own rename theirs)."""
    for variant in REGISTRY:
        if variant.rename is not None:
            key = variant.rename(key)
    return key


def _convert(key: str) -> Optional[str]:
    if key.startswith(tuple(prefix for v in REGISTRY for prefix in v.own_keys)):  # the same name in both layouts
        return key
    if key in _TOP_PARAMETERS:
        return _TOP_PARAMETERS[key]
    stem = key.split(".", 1)[0]
    if stem in ("blocks", "vace_blocks") and key.count(".") >= 2:
        _, index, rest = key.split(".", 2)
        if not index.isdigit():
            return None
        if rest in _BLOCK_PARAMETERS:
            return f"{stem}.{index}.{_BLOCK_PARAMETERS[rest]}"
        if rest.startswith(tuple(prefix for v in REGISTRY for prefix in v.block_keys)):
            return key
        module, _, kind = rest.rpartition(".")
        return f"{stem}.{index}.{_BLOCK[module]}.{kind}" if module in _BLOCK and kind in ("weight", "bias") else None
    module, _, kind = key.rpartition(".")
    return f"{_TOP[module]}.{kind}" if module in _TOP and kind in ("weight", "bias") else None
