"""HiDream I1 / E1 detection from a header alone, as ComfyUI's model_detection tells it (`caption_projection.0`):
ComfyUI and diffusers name the weights alike; the architecture facts a header cannot show are ComfyUI's constants
(20 heads, rotary axes (64, 32, 32) of the 128 head size, 2 of the routed experts active, 32 Llama layers: block i
reads layer min(i, 31)). HiDream-O1 (`t_embedder1`, pixel space) is another architecture and is not taken."""
from __future__ import annotations

from typing import Optional

from ...checkpoints.header import Header
from ...checkpoints.loading import count_blocks, find_prefix, folder_entries, shape_of, strip_prefix
from ...contract import Detection
from ..family import layout_detection

NAME = "hidream"
DESCRIPTION = "HiDream I1 (full, dev, fast) / E1 (edit)"
CLASS_NAME = "HiDreamImageTransformer2DModel"
PATCH = 2
HEADS = 20
LLAMA_DEPTH = 32
ACTIVE_EXPERTS = 2
ANCHORS = ("caption_projection.0.linear.weight", "double_stream_blocks.0.block.adaLN_modulation.1.bias",
           "x_embedder.proj.weight", "final_layer.linear.weight")
CONFIG_KEYS = ("patch_size", "in_channels", "out_channels", "num_layers", "num_single_layers", "attention_head_dim",
               "num_attention_heads", "caption_channels", "text_emb_dim", "num_routed_experts",
               "num_activated_experts", "axes_dims_rope", "max_resolution", "llama_layers")


def detect(header: Header) -> Optional[Detection]:
    folder = folder_entries(header, CLASS_NAME, CONFIG_KEYS)
    if folder is not None:
        return layout_detection(header, NAME, ("diffusers", "", folder)) if folder else None
    prefix = find_prefix(header.tensors, ANCHORS)
    if prefix is None:
        return None
    return layout_detection(header, NAME, ("diffusers", prefix, architecture(strip_prefix(header.tensors, prefix))))


def architecture(keys: dict) -> dict:
    """HiDreamImageTransformer2DModel config from header shapes (keys without prefix)."""
    width, in_features = shape_of(keys, "x_embedder.proj.weight")
    if width % HEADS or (width // HEADS) % 8:
        raise ValueError(f"HiDream width {width} is not {HEADS} heads of a size divisible by 8 (ComfyUI's HiDream "
                         f"has {HEADS} heads of 128)")
    head_dim = width // HEADS
    blocks = count_blocks(keys, "double_stream_blocks"), count_blocks(keys, "single_stream_blocks")
    return {
        "patch_size": PATCH,
        "in_channels": in_features // (PATCH * PATCH),
        "out_channels": shape_of(keys, "final_layer.linear.weight")[0] // (PATCH * PATCH),
        "num_layers": blocks[0],
        "num_single_layers": blocks[1],
        "attention_head_dim": head_dim,
        "num_attention_heads": HEADS,
        "caption_channels": [shape_of(keys, f"caption_projection.{sum(blocks)}.linear.weight")[1],
                             shape_of(keys, "caption_projection.0.linear.weight")[1]],
        "text_emb_dim": shape_of(keys, "p_embedder.pooled_embedder.linear_1.weight")[1],
        "num_routed_experts": count_blocks(keys, "double_stream_blocks.0.block.ff_i.experts"),
        "num_activated_experts": ACTIVE_EXPERTS,
        "axes_dims_rope": [head_dim // 2, head_dim // 4, head_dim // 4],
        "max_resolution": [128, 128],
        "llama_layers": [min(i, LLAMA_DEPTH - 1) for i in range(sum(blocks))],
    }
