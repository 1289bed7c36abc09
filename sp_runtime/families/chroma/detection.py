"""Chroma detection from a header alone, as ComfyUI's model_detection tells it from Flux.1: Flux's double / single
blocks with a `distilled_guidance_layer` instead of `time_in` / `vector_in` / per-block modulation."""
from __future__ import annotations

from typing import Optional

from ...sp.tokens import rope_axes
from ...contract import Detection
from ...checkpoints.loading import count_blocks, find_prefix, shape_of, strip_prefix
from ...checkpoints.header import Header, header_config

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
    folder_config = header_config(header)
    if folder_config is not None:
        if folder_config.get("_class_name") != CLASS_NAME:
            return None
        config = {key: folder_config[key] for key in CONFIG_KEYS if key in folder_config}
        config["axes_dims_rope"] = tuple(config.get("axes_dims_rope", (16, 56, 56)))
        config["out_channels"] = config.get("out_channels") or config["in_channels"]
        return _detection(header, "diffusers", "", config)
    for layout, anchors in (("original", ORIGINAL_ANCHORS), ("diffusers", DIFFUSERS_ANCHORS)):
        prefix = find_prefix(header.tensors, anchors)
        if prefix is not None:
            keys = strip_prefix(header.tensors, prefix)
            if RADIANCE_KEY in keys:
                raise ValueError(f"{header.path!r} is Chroma Radiance (pixel space: a NeRF decoder head per patch, "
                                 f"which diffusers' ChromaTransformer2DModel has not), which is not supported; "
                                 f"Chroma (HD, v48-v50) loads")
            return _detection(header, layout, prefix, architecture(keys, layout))
    return None


def _detection(header: Header, layout: str, prefix: str, config: dict) -> Detection:
    return Detection(family=NAME, variant="", layout=layout, prefix=prefix, config=config,
                     files=header.source.files)


def architecture(keys: dict, layout: str) -> dict:
    """ChromaTransformer2DModel config from header shapes (keys without prefix)."""
    index = ("original", "diffusers").index(layout)
    names = {fact: pair[index] for fact, pair in KEYS.items()}
    hidden, in_features = shape_of(keys, names["embed"])
    head_dim = shape_of(keys, names["head_norm"])[0]
    if hidden % head_dim:
        raise ValueError(f"Chroma width {hidden} is not a multiple of its head size {head_dim}")
    approximator_hidden, approximator_in = shape_of(keys, f"{GUIDANCE}.in_proj.weight")
    return {
        "patch_size": 1,
        "in_channels": in_features,
        "out_channels": shape_of(keys, names["out"])[0],
        "num_layers": count_blocks(keys, names["double_blocks"]),
        "num_single_layers": count_blocks(keys, names["single_blocks"]),
        "attention_head_dim": head_dim,
        "num_attention_heads": hidden // head_dim,
        "joint_attention_dim": shape_of(keys, names["text"])[1],
        "axes_dims_rope": rope_axes(head_dim),
        "approximator_num_channels": approximator_in,
        "approximator_hidden_dim": approximator_hidden,
        "approximator_layers": count_blocks(keys, f"{GUIDANCE}.layers"),
    }
