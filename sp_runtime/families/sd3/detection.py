"""SD3 / SD3.5 detection from a header alone, as ComfyUI's model_detection reads an MMDiT: width from
`x_embedder.proj.weight` (64 per head), depth from `joint_blocks`, `pos_embed_max_size` from `pos_embed`, q/k
RMS norms (`ln_q`, SD3.5) and the image-only second attention of SD3.5 Medium (`x_block.attn2`, MMDiT-X)."""
from __future__ import annotations

import math
from typing import Optional

from ...contract import Detection
from ...checkpoints.loading import count_blocks, folder_entries, layout_keys, shape_of, two_layouts
from ...checkpoints.header import Header
from ..family import layout_detection

NAME = "sd3"
DESCRIPTION = "SD3 / SD3.5 (Large, Large Turbo, Medium)"
CLASS_NAME = "SD3Transformer2DModel"
HEAD_DIM = 64  # ComfyUI's MMDiT: heads = width / 64 (checkpoints without q/k norms do not show it)
ORIGINAL_ANCHORS = ("joint_blocks.0.context_block.attn.qkv.weight", "x_embedder.proj.weight", "pos_embed",
                    "t_embedder.mlp.0.weight", "final_layer.linear.weight")
DIFFUSERS_ANCHORS = ("pos_embed.proj.weight", "transformer_blocks.0.attn.add_q_proj.weight",
                     "time_text_embed.text_embedder.linear_1.weight", "norm_out.linear.weight")
CONFIG_KEYS = ("sample_size", "patch_size", "in_channels", "num_layers", "attention_head_dim", "num_attention_heads",
               "joint_attention_dim", "caption_projection_dim", "pooled_projection_dim", "out_channels",
               "pos_embed_max_size", "dual_attention_layers", "qk_norm")
# (ComfyUI key, diffusers key) of each fact, prefix stripped
KEYS = {"embed": ("x_embedder.proj.weight", "pos_embed.proj.weight"),
        "positions": ("pos_embed", "pos_embed.pos_embed"),
        "blocks": ("joint_blocks", "transformer_blocks"),
        "head_norm": ("joint_blocks.0.x_block.attn.ln_q.weight", "transformer_blocks.0.attn.norm_q.weight"),
        "text": ("context_embedder.weight", "context_embedder.weight"),
        "pooled": ("y_embedder.mlp.0.weight", "time_text_embed.text_embedder.linear_1.weight"),
        "out": ("final_layer.linear.weight", "proj_out.weight"),
        "second_attention": ("x_block.attn2.qkv.weight", "attn2.to_q.weight")}


def detect(header: Header) -> Optional[Detection]:
    folder = folder_entries(header, CLASS_NAME, CONFIG_KEYS, {"dual_attention_layers": ()}, ("dual_attention_layers",))
    found = two_layouts(header, folder, (ORIGINAL_ANCHORS, DIFFUSERS_ANCHORS),
                        lambda keys, layout: architecture(keys, layout, header.path))
    return layout_detection(header, NAME, found, variant_of)


def variant_of(config: dict) -> str:
    """3.5_medium (MMDiT-X: a second attention), 3.5_large (q/k norms), else 3_medium (SD3.0)."""
    if config.get("dual_attention_layers"):
        return "3.5_medium"
    return "3.5_large" if config.get("qk_norm") else "3_medium"


def architecture(keys: dict, layout: str, path: str = "") -> dict:
    """SD3Transformer2DModel config from header shapes (keys without prefix) in the "original" (ComfyUI) or
    "diffusers" layout."""
    if "context_processor.layers.0.attn.qkv.weight" in keys:
        raise ValueError(f"{path!r} is an MMDiT with a context processor, which is not supported (SD3 and SD3.5 "
                         f"Large / Medium load)")
    names = layout_keys(KEYS, layout)
    width, in_channels, patch, _ = shape_of(keys, names["embed"])
    head_dim = shape_of(keys, names["head_norm"])[0] if names["head_norm"] in keys else HEAD_DIM
    if width % head_dim:
        raise ValueError(f"MMDiT width {width} is not a multiple of its head size {head_dim}")
    positions = shape_of(keys, names["positions"])[1]
    side = math.isqrt(positions)
    if side * side != positions:
        raise ValueError(f"MMDiT positional table of {positions} entries is not square: unsupported variant")
    blocks = count_blocks(keys, names["blocks"])
    text_width, text_features = shape_of(keys, names["text"])
    return {
        "sample_size": 128,  # the default grid diffusers builds its table for; the file's table replaces it
        "patch_size": patch,
        "in_channels": in_channels,
        "num_layers": blocks,
        "attention_head_dim": head_dim,
        "num_attention_heads": width // head_dim,
        "joint_attention_dim": text_features,
        "caption_projection_dim": text_width,
        "pooled_projection_dim": shape_of(keys, names["pooled"])[1],
        "out_channels": shape_of(keys, names["out"])[0] // (patch * patch),
        "pos_embed_max_size": side,
        "dual_attention_layers": tuple(i for i in range(blocks)
                                       if f"{names['blocks']}.{i}.{names['second_attention']}" in keys),
        "qk_norm": "rms_norm" if names["head_norm"] in keys else None,
    }
