"""HunyuanVideo 1.0 detection from a header alone (no weights read, no diffusers): key layout (Tencent / ComfyUI or
diffusers), prefix, variant (by input channels, as ComfyUI's supported_models) and the
HunyuanVideoTransformer3DModel config; HunyuanVideo 1.5 and HunyuanImage 2.1 files are left to others."""
from __future__ import annotations

from typing import Optional

from ...checkpoints.header import Header
from ...checkpoints.loading import count_blocks, folder_entries, layout_keys, shape_of, two_layouts
from ...contract import Detection
from ...sp.tokens import rope_axes
from .keys import REFINER_STEM, SHARED_ARCHITECTURE_KEYS, comfy_names
from ..family import layout_detection

NAME = "hunyuan_video"
ROPE_THETA = 256
VARIANTS = {16: "t2v", 33: "i2v", 32: "skyreels_i2v"}  # by input channels, as ComfyUI's supported_models
CONFIG_KEYS = ("in_channels", "out_channels", "num_attention_heads", "attention_head_dim", "num_layers",
               "num_single_layers", "num_refiner_layers", "mlp_ratio", "patch_size", "patch_size_t",
               "guidance_embeds", "text_embed_dim", "pooled_projection_dim", "rope_axes_dim")
# ComfyUI's module names (after keys.comfy_name) and diffusers' of the facts a header shows
ARCHITECTURE_KEYS = {
    **SHARED_ARCHITECTURE_KEYS,
    "pooled": ("vector_in.in_layer.weight", "time_text_embed.text_embedder.linear_1.weight"),
    "guidance": ("guidance_in.in_layer.weight", "time_text_embed.guidance_embedder.linear_1.weight"),
}
ORIGINAL_ANCHORS = (f"{REFINER_STEM}.0.norm1.weight", "img_in.proj.weight", "final_layer.linear.weight")
DIFFUSERS_ANCHORS = ("context_embedder.token_refiner.refiner_blocks.0.norm1.weight", "x_embedder.proj.weight",
                     "time_text_embed.timestep_embedder.linear_1.weight", "proj_out.weight")
VERSION_15_KEYS = ("cond_type_embedding.weight", "cond_type_embed.weight")  # HunyuanVideo 1.5 (its own family)


def detect(header: Header) -> Optional[Detection]:
    """HunyuanVideo 1.0 from its header alone; None for other files (HunyuanVideo 1.5, HunyuanImage 2.1 ...)."""
    if any(key.endswith(VERSION_15_KEYS) for key in header.tensors):
        return None
    folder = folder_entries(header, "HunyuanVideoTransformer3DModel", CONFIG_KEYS, tuples=("rope_axes_dim",))
    found = two_layouts(header, folder, (ORIGINAL_ANCHORS, DIFFUSERS_ANCHORS), architecture)
    return layout_detection(header, NAME, found, lambda config: VARIANTS.get(config["in_channels"], ""))


def architecture(keys: dict, layout: str) -> Optional[dict]:
    """HunyuanVideoTransformer3DModel config from a header (keys without prefix: Tencent, ComfyUI or diffusers names);
    None for a 2-D patch (HunyuanImage 2.1)."""
    names, keys = layout_keys(ARCHITECTURE_KEYS, layout), comfy_names(keys) if layout == "original" else keys
    if len(shape_of(keys, names["embed"])) != 5:
        return None
    return {**shared_architecture(keys, names, "HunyuanVideo"),
            "num_single_layers": count_blocks(keys, names["single_blocks"]),
            "guidance_embeds": names["guidance"] in keys,
            "pooled_projection_dim": shape_of(keys, names["pooled"])[1]}


def shared_architecture(keys: dict, names: dict, what: str) -> dict:
    """The config entries HunyuanVideo 1.0 and 1.5 read alike from a header (names: keys.SHARED_ARCHITECTURE_KEYS
    in the file's layout)."""
    hidden, in_channels, patch_t, patch, patch_w = shape_of(keys, names["embed"])
    head_dim = shape_of(keys, names["head_norm"])[0]
    if patch != patch_w or hidden % head_dim:
        raise ValueError(f"{what} patch ({patch_t}, {patch}, {patch_w}) / width {hidden} with head size {head_dim}: "
                         f"unsupported variant")
    return {
        "in_channels": in_channels,
        "out_channels": shape_of(keys, names["out"])[0] // (patch_t * patch * patch),
        "num_attention_heads": hidden // head_dim,
        "attention_head_dim": head_dim,
        "num_layers": count_blocks(keys, names["double_blocks"]),
        "num_refiner_layers": count_blocks(keys, names["refiner_blocks"]),
        "mlp_ratio": shape_of(keys, names["mlp"])[0] / hidden,
        "patch_size": patch,
        "patch_size_t": patch_t,
        "text_embed_dim": shape_of(keys, names["text"])[1],
        "rope_axes_dim": rope_axes(head_dim),
    }
