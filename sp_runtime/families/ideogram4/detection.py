"""Ideogram 4 detection from a header alone, as ComfyUI reads its files (`embed_image_indicator`, with or without
`model.diffusion_model.`; or diffusers' Ideogram4Transformer2DModel names): the Ideogram4Transformer2DModel config
from the header's shapes. ComfyUI fixes the rotary (theta 5e6, MRoPE sections (24, 20, 20) at head size 256); other
head sizes (the tiny test models) scale the sections with it."""
from __future__ import annotations

from typing import Optional

from ...checkpoints.header import Header
from ...checkpoints.loading import count_blocks, folder_entries, shape_of, two_layouts
from ...contract import Detection
from ..family import layout_detection

NAME = "ideogram4"
CLASS_NAME = "Ideogram4Transformer2DModel"
ROPE_THETA = 5_000_000
MROPE_SECTION = (24, 20, 20)  # at head size 256 (ComfyUI's supported_models.Ideogram4)
ORIGINAL_ANCHORS = ("embed_image_indicator.weight", "input_proj.weight", "layers.0.attention.qkv.weight")
DIFFUSERS_ANCHORS = ("embed_image_indicator.weight", "input_proj.weight", "layers.0.attention.to_q.weight")
CONFIG_KEYS = ("in_channels", "num_layers", "attention_head_dim", "num_attention_heads", "intermediate_size",
               "adaln_dim", "llm_features_dim", "rope_theta", "mrope_section", "norm_eps")


def detect(header: Header) -> Optional[Detection]:
    folder = folder_entries(header, CLASS_NAME, CONFIG_KEYS, tuples=("mrope_section",))
    found = two_layouts(header, folder, (ORIGINAL_ANCHORS, DIFFUSERS_ANCHORS), lambda keys, layout: architecture(keys))
    return layout_detection(header, NAME, found, lambda config: "image")


def architecture(keys: dict) -> dict:
    """Ideogram4Transformer2DModel config from header shapes (keys without prefix; these names are the same in
    both layouts)."""
    hidden, in_channels = shape_of(keys, "input_proj.weight")
    head_dim = shape_of(keys, "layers.0.attention.norm_q.weight")[0]
    sections = tuple(size * head_dim // 256 for size in MROPE_SECTION)
    if hidden % head_dim or head_dim % 2 or 3 * max(sections[1:]) > head_dim // 2 or in_channels % 4:
        raise ValueError(f"Ideogram 4 width {hidden} with head size {head_dim} and {in_channels} input channels: "
                         f"the width must be whole heads, the head size hold the MRoPE sections {sections}, the "
                         f"input 2 x 2 patches")
    return {"in_channels": in_channels, "num_layers": count_blocks(keys, "layers"), "attention_head_dim": head_dim,
            "num_attention_heads": hidden // head_dim,
            "intermediate_size": shape_of(keys, "layers.0.feed_forward.w1.weight")[0],
            "adaln_dim": shape_of(keys, "adaln_proj.weight")[0],
            "llm_features_dim": shape_of(keys, "llm_cond_proj.weight")[1], "rope_theta": ROPE_THETA,
            "mrope_section": sections, "norm_eps": 1e-5}
