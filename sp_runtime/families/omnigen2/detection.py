"""OmniGen2 detection from a header alone: ComfyUI's keys (its OmniGen2Transformer2DModel, whose names are diffusers'
Lumina 2 names plus the reference-image modules), with or without `model.diffusion_model.`, and the config of the
model loading.py builds. Boogu-Image files (OmniGen2's modules plus a dual-stream stage) are left to the refusals."""
from __future__ import annotations

from typing import Optional

from ...checkpoints.header import Header
from ...checkpoints.loading import count_blocks, find_prefix, shape_of, strip_prefix
from ...contract import Detection

NAME = "omnigen2"
CLASS_NAME = "Lumina2Transformer2DModel"  # the blocks, embedders and head are Lumina 2's (loading.py adds the rest)
PATCH = 2
ROPE_THETA = 10000.0
AXES_LENS = (1024, 1664, 1664)  # ComfyUI's (diffusers' rotary table sizes; the plan computes angles directly)
TIMESTEP_SCALE = 1000.0         # ComfyUI's timestep_scale: sinusoids of 1000 (1 - sigma)
REFERENCE_SLOTS = 5             # rows of image_index_embedding: at most this many reference images
ANCHORS = ("time_caption_embed.timestep_embedder.linear_1.bias", "ref_image_patch_embedder.weight",
           "x_embedder.weight", "ref_image_refiner.0.attn.to_q.weight", "layers.0.attn.to_k.weight",
           "layers.0.feed_forward.linear_1.weight", "image_index_embedding")
DUAL_STREAM = "double_stream_layers.0.img_instruct_attn.processor.img_to_q.weight"  # Boogu-Image
CONFIG_KEYS = ("in_channels", "hidden_size", "num_layers", "num_refiner_layers", "num_attention_heads",
               "num_kv_heads", "cap_feat_dim", "axes_dim_rope", "multiple_of")


def detect(header: Header) -> Optional[Detection]:
    """OmniGen2 from its header alone (no weights read); None when the file is another family's."""
    prefix = find_prefix(header.tensors, ANCHORS)
    if prefix is None or prefix + DUAL_STREAM in header.tensors:
        return None
    keys = strip_prefix(header.tensors, prefix)
    return Detection(family=NAME, variant="", layout="original", prefix=prefix, config=architecture(keys),
                     files=header.source.files)


def architecture(keys: dict) -> dict:
    """The model's config from header shapes (keys without prefix); ComfyUI fixes these for the released size
    (2520 wide, 21 query / 7 key-value heads of 120, rotary axes 40 / 40 / 40), read here from the shapes."""
    dim, patch_features = shape_of(keys, "x_embedder.weight")
    head_dim = shape_of(keys, "layers.0.attn.norm_q.weight")[0]
    if dim % head_dim or head_dim % 6:
        raise ValueError(f"OmniGen2 width {dim} with head size {head_dim}: the width must be whole heads and the "
                         f"head size carry three even rotary axes")
    heads, kv_heads = dim // head_dim, shape_of(keys, "layers.0.attn.to_k.weight")[0] // head_dim
    if heads % kv_heads:
        raise ValueError(f"OmniGen2 with {heads} query heads over {kv_heads} key / value heads is not supported")
    if shape_of(keys, "image_index_embedding") != (REFERENCE_SLOTS, dim):
        raise ValueError(f"OmniGen2 image_index_embedding of shape {shape_of(keys, 'image_index_embedding')}; "
                         f"ComfyUI's model has ({REFERENCE_SLOTS}, {dim})")
    return {
        "patch_size": PATCH,
        "in_channels": patch_features // (PATCH * PATCH),
        "hidden_size": dim,
        "num_layers": count_blocks(keys, "layers"),
        "num_refiner_layers": count_blocks(keys, "noise_refiner"),
        "num_attention_heads": heads,
        "num_kv_heads": kv_heads,
        "multiple_of": _multiple_of(shape_of(keys, "layers.0.feed_forward.linear_1.weight")[0], dim),
        "ffn_dim_multiplier": None,
        "cap_feat_dim": shape_of(keys, "time_caption_embed.caption_embedder.0.weight")[0],
        "axes_dim_rope": (head_dim // 3,) * 3,  # (40, 40, 40) at the released head size 120, as ComfyUI fixes it
        "axes_lens": AXES_LENS,
    }


def _multiple_of(hidden: int, dim: int) -> int:
    """The feed-forward rounding (4 x dim rounded up to it) that gives the file's width: 256 in ComfyUI's model."""
    for multiple in (256, 128, 64, 32, 16, 8, 4, 2, 1):
        if hidden == -(-4 * dim // multiple) * multiple:
            return multiple
    raise ValueError(f"OmniGen2 feed-forward width {hidden} is not 4 x {dim} rounded up as ComfyUI's model builds "
                     f"it; this variant is not supported")
