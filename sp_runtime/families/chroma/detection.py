"""Chroma detection from a header alone, as ComfyUI's model_detection tells it from Flux.1: Flux's double / single
blocks with a `distilled_guidance_layer` instead of `time_in` / `vector_in` / per-block modulation."""
from __future__ import annotations

from typing import Optional

from ...sp.tokens import rope_axes
from ...contract import Detection
from ..flux.detection import shared_architecture
from ...checkpoints.loading import count_blocks, folder_entries, layout_keys, shape_of, two_layouts
from ...checkpoints.header import Header
from ..family import layout_detection

NAME = "chroma"
DESCRIPTION = "Chroma (HD, v48-v50)"
CLASS_NAME = "ChromaTransformer2DModel"
GUIDANCE = "distilled_guidance_layer"
ORIGINAL_ANCHORS = (f"{GUIDANCE}.in_proj.weight", "double_blocks.0.img_attn.norm.key_norm.scale", "txt_in.weight",
                    "final_layer.linear.weight")
DIFFUSERS_ANCHORS = (f"{GUIDANCE}.in_proj.weight", "transformer_blocks.0.attn.norm_added_k.weight",
                     "context_embedder.weight", "proj_out.weight")
RADIANCE_KEY = "nerf_blocks.0.norm.scale"
CONFIG_KEYS = ("patch_size", "in_channels", "out_channels", "num_layers", "num_single_layers", "attention_head_dim",
               "num_attention_heads", "joint_attention_dim", "axes_dims_rope", "approximator_num_channels",
               "approximator_hidden_dim", "approximator_layers")
# (ComfyUI key, diffusers key) of each fact, prefix stripped
KEYS = {"embed": ("img_in.weight", "x_embedder.weight"),
        "head_norm": ("double_blocks.0.img_attn.norm.key_norm.scale", "transformer_blocks.0.attn.norm_k.weight"),
        "double_blocks": ("double_blocks", "transformer_blocks"),
        "single_blocks": ("single_blocks", "single_transformer_blocks"),
        "text": ("txt_in.weight", "context_embedder.weight"),
        "out": ("final_layer.linear.weight", "proj_out.weight")}


def detect(header: Header) -> Optional[Detection]:
    folder = folder_entries(header, CLASS_NAME, CONFIG_KEYS, {"axes_dims_rope": (16, 56, 56)}, ("axes_dims_rope",))
    if folder:
        folder["out_channels"] = folder.get("out_channels") or folder["in_channels"]
    found = two_layouts(header, folder, (ORIGINAL_ANCHORS, DIFFUSERS_ANCHORS),
                        lambda keys, layout: architecture(keys, layout, header.path))
    return layout_detection(header, NAME, found)


def architecture(keys: dict, layout: str, path: str = "") -> dict:
    """ChromaTransformer2DModel config from header shapes (keys without prefix)."""
    if RADIANCE_KEY in keys:
        raise ValueError(f"{path!r} is Chroma Radiance (pixel space: a NeRF decoder head per patch, which diffusers' "
                         f"ChromaTransformer2DModel has not), which is not supported; Chroma (HD, v48-v50) loads")
    config = shared_architecture(keys, layout_keys(KEYS, layout), "Chroma")
    approximator_hidden, approximator_in = shape_of(keys, f"{GUIDANCE}.in_proj.weight")
    return {**config, "axes_dims_rope": rope_axes(config["attention_head_dim"]),
            "approximator_num_channels": approximator_in, "approximator_hidden_dim": approximator_hidden,
            "approximator_layers": count_blocks(keys, f"{GUIDANCE}.layers")}
