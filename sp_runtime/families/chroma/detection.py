"""Chroma detection from a header alone, as ComfyUI's model_detection tells it from Flux.1: Flux's double / single
blocks with a `distilled_guidance_layer` instead of `time_in` / `vector_in` / per-block modulation; Chroma Radiance
(variant "radiance": `nerf_blocks`, a pixel patch convolution `img_in_patch`, no final layer) with its NeRF head's
facts."""
from __future__ import annotations

from typing import Optional

from ...sp.tokens import rope_axes
from ...contract import Detection
from ..flux.detection import shared_architecture
from ...checkpoints.loading import (count_blocks, find_prefix, folder_entries, layout_keys, shape_of, strip_prefix,
                                    two_layouts)
from ...checkpoints.header import Header
from ..family import layout_detection

NAME = "chroma"
DESCRIPTION = "Chroma (HD, v48-v50, Radiance)"
CLASS_NAME = "ChromaTransformer2DModel"
GUIDANCE = "distilled_guidance_layer"
ORIGINAL_ANCHORS = (f"{GUIDANCE}.in_proj.weight", "double_blocks.0.img_attn.norm.key_norm.scale", "txt_in.weight",
                    "final_layer.linear.weight")
DIFFUSERS_ANCHORS = (f"{GUIDANCE}.in_proj.weight", "transformer_blocks.0.attn.norm_added_k.weight",
                     "context_embedder.weight", "proj_out.weight")
RADIANCE_KEY = "nerf_blocks.0.norm.scale"
RADIANCE_ANCHORS = (f"{GUIDANCE}.in_proj.weight", "img_in_patch.weight", "txt_in.weight",
                    "nerf_image_embedder.embedder.0.weight", "nerf_blocks.0.param_generator.weight")
# ComfyUI's marker tensors of Radiance files: x0 prediction (the output turned into a velocity), sequential text ids
RADIANCE_MARKERS = {"x0": "__x0__", "sequential_text_ids": "__sequential__"}
RADIANCE_KEYS = ("pixel_patch", "nerf_hidden_size", "nerf_mlp_ratio", "nerf_depth", "nerf_max_freqs", "nerf_head",
                 *RADIANCE_MARKERS)
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
    prefix = find_prefix(header.tensors, RADIANCE_ANCHORS)
    if prefix is not None:
        config = radiance_architecture(strip_prefix(header.tensors, prefix), header.path)
        return layout_detection(header, NAME, ("original", prefix, config), lambda config: "radiance")
    folder = folder_entries(header, CLASS_NAME, CONFIG_KEYS, {"axes_dims_rope": (16, 56, 56)}, ("axes_dims_rope",))
    if folder:
        folder["out_channels"] = folder.get("out_channels") or folder["in_channels"]
    found = two_layouts(header, folder, (ORIGINAL_ANCHORS, DIFFUSERS_ANCHORS),
                        lambda keys, layout: architecture(keys, layout, header.path))
    return layout_detection(header, NAME, found)


def architecture(keys: dict, layout: str, path: str = "") -> dict:
    """ChromaTransformer2DModel config from header shapes (keys without prefix)."""
    if RADIANCE_KEY in keys:
        raise ValueError(f"{path!r} has Chroma Radiance's NeRF blocks but not its pixel patch embedding "
                         f"({', '.join(RADIANCE_ANCHORS)}): an incomplete or unknown Chroma Radiance file")
    return _trunk(keys, layout_keys(KEYS, layout))


def _trunk(keys: dict, names: dict) -> dict:
    config = shared_architecture(keys, names, "Chroma")
    approximator_hidden, approximator_in = shape_of(keys, f"{GUIDANCE}.in_proj.weight")
    return {**config, "axes_dims_rope": rope_axes(config["attention_head_dim"]),
            "approximator_num_channels": approximator_in, "approximator_hidden_dim": approximator_hidden,
            "approximator_layers": count_blocks(keys, f"{GUIDANCE}.layers")}


def radiance_architecture(keys: dict, path: str = "") -> dict:
    """Chroma Radiance: the trunk's config (x_embedder takes a pixel patch's C*P*P values, as ComfyUI's strided
    convolution `img_in_patch` does) and the NeRF head's facts (RADIANCE_KEYS), from the ComfyUI file's shapes."""
    hidden, channels, patch, patch_w = shape_of(keys, "img_in_patch.weight")
    norm = next((key for key in ("double_blocks.0.img_attn.norm.key_norm.scale",
                                 "double_blocks.0.img_attn.norm.key_norm.weight") if key in keys), KEYS["head_norm"][0])
    pixels = channels * patch * patch_w  # x_embedder's inputs and the tokens' output features
    shapes = {"img_in.weight": ("F32", (hidden, pixels)), "final_layer.linear.weight": ("F32", (pixels, hidden))}
    config = _trunk({**keys, **shapes}, {**layout_keys(KEYS, "original"), "head_norm": norm})
    width, features = shape_of(keys, "nerf_image_embedder.embedder.0.weight")
    freqs = round((features - channels) ** 0.5)
    rows = shape_of(keys, "nerf_blocks.0.param_generator.weight")[0]
    heads = [name for name, key in (("conv", "nerf_final_layer_conv.conv.weight"),
                                    ("linear", "nerf_final_layer.linear.weight")) if key in keys]
    if patch != patch_w or freqs * freqs != features - channels or rows % (3 * width * width) or not heads:
        raise ValueError(f"{path!r} looks like Chroma Radiance but its NeRF head is not one ComfyUI builds (patch "
                         f"{patch}x{patch_w}, embedder {width}x{features}, parameter rows {rows}, final layer "
                         f"{heads or 'missing'})")
    return {**config, "pixel_patch": patch, "nerf_hidden_size": width, "nerf_mlp_ratio": rows // (3 * width * width),
            "nerf_depth": count_blocks(keys, "nerf_blocks"), "nerf_max_freqs": freqs, "nerf_head": heads[0],
            **{fact: marker in keys for fact, marker in RADIANCE_MARKERS.items()}}
