"""HiDream-O1 detection from a header alone, as ComfyUI's model_detection tells it (`t_embedder1.mlp.0.weight` with
`x_embedder.proj1.weight`): the Qwen3-VL text decoder's widths from its shapes, ComfyUI's constants for what a header
cannot show (rotary theta 5e6, interleaved MRoPE sections (24, 20, 20) at head size 128, <|tms_token|> id 151673,
RMSNorm eps 1e-6). The vision tower (`visual.*`, reference images only) from its shapes where the file holds one
(vision.py; ComfyUI's 16 heads, which a header cannot show), else `vision` is None and reference images are refused."""
from __future__ import annotations

import math
from typing import Optional

from ...checkpoints.header import Header
from ...checkpoints.loading import count_blocks, find_prefix, shape_of, strip_prefix
from ...contract import Detection

NAME = "hidream_o1"
DESCRIPTION = "HiDream-O1 (text to image, edit and multi-reference)"
ANCHORS = ("t_embedder1.mlp.0.weight", "x_embedder.proj1.weight", "language_model.embed_tokens.weight")
TMS_TOKEN_ID = 151673      # <|tms_token|>: its embedding is replaced by the timestep embedding
ROPE_THETA = 5_000_000.0
MROPE_SECTION = (24, 20, 20)  # at head size 128 (ComfyUI's HiDreamO1TextConfig.rope_dims)
RMS_EPS = 1e-6
VISION_HEADS = 16  # ComfyUI's QWEN3VL_VISION_DEFAULTS
CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "patch_size", "bottleneck_dim", "rope_theta", "mrope_section",
               "rms_norm_eps", "tms_token_id", "vision")
LAYER = "language_model.layers.0."
VISION = "visual."


def detect(header: Header) -> Optional[Detection]:
    prefix = find_prefix(header.tensors, ANCHORS)
    if prefix is None:
        return None
    config = architecture(strip_prefix(header.tensors, prefix), header.path)
    return Detection(family=NAME, variant="t2i", layout="original", prefix=prefix, config=config,
                     files=header.source.files)


def architecture(keys: dict, path: str = "") -> dict:
    """The decoder's config from shapes (keys without prefix) and ComfyUI's constants."""
    vocab, hidden = shape_of(keys, "language_model.embed_tokens.weight")
    head_dim = shape_of(keys, LAYER + "self_attn.q_norm.weight")[0]
    bottleneck, patch_features = shape_of(keys, "x_embedder.proj1.weight")
    patch = math.isqrt(patch_features // 3)
    sections = tuple(size * head_dim // 128 for size in MROPE_SECTION)
    if vocab <= TMS_TOKEN_ID or 3 * patch * patch != patch_features or head_dim % 2 \
            or 3 * max(sections[1:]) > head_dim // 2:
        raise ValueError(f"{path!r} looks like HiDream-O1 but its shapes do not fit ComfyUI's model (a vocabulary "
                         f"of {vocab} tokens must hold <|tms_token|> {TMS_TOKEN_ID}, {patch_features} patch features "
                         f"3 x p x p, head size {head_dim} the MRoPE sections {sections})")
    return {"vocab_size": vocab, "hidden_size": hidden,
            "intermediate_size": shape_of(keys, LAYER + "mlp.gate_proj.weight")[0],
            "num_layers": count_blocks(keys, "language_model.layers"),
            "num_attention_heads": shape_of(keys, LAYER + "self_attn.q_proj.weight")[0] // head_dim,
            "num_key_value_heads": shape_of(keys, LAYER + "self_attn.k_proj.weight")[0] // head_dim,
            "head_dim": head_dim, "patch_size": patch, "bottleneck_dim": bottleneck, "rope_theta": ROPE_THETA,
            "mrope_section": sections, "rms_norm_eps": RMS_EPS, "tms_token_id": TMS_TOKEN_ID,
            "vision": vision_architecture(keys, hidden, path)}


def vision_architecture(keys: dict, out: int, path: str = "") -> Optional[dict]:
    """The vision tower's sizes (vision.VisionTower's arguments) from `visual.*` shapes; None without a tower."""
    if VISION + "merger.linear_fc2.weight" not in keys:
        return None
    width, channels, temporal, patch, _ = shape_of(keys, VISION + "patch_embed.proj.weight")
    positions = shape_of(keys, VISION + "pos_embed.weight")[0]
    merged = shape_of(keys, VISION + "merger.linear_fc1.weight")[1]
    merge = math.isqrt(merged // width)
    if width % VISION_HEADS or (width // VISION_HEADS) % 4 or merge * merge * width != merged \
            or math.isqrt(positions) ** 2 != positions or shape_of(keys, VISION + "merger.linear_fc2.weight")[0] != out:
        raise ValueError(f"{path!r} has a HiDream-O1 vision tower whose shapes do not fit ComfyUI's (width {width} "
                         f"over {VISION_HEADS} heads of a size divisible by 4, {merged} merged features, {positions} "
                         f"positions a square)")
    return {"width": width, "depth": count_blocks(keys, VISION + "blocks"),
            "inner": shape_of(keys, VISION + "blocks.0.mlp.linear_fc1.weight")[0], "patch": patch,
            "temporal": temporal, "positions": positions, "merge": merge, "out": out, "channels": channels}
