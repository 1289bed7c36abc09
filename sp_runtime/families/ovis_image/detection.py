"""Ovis-Image detection from a header alone, as ComfyUI's model_detection tells it: a Flux-layout file (ComfyUI's
`double_blocks` / `single_blocks`) whose MLPs are SwiGLU (`img_mlp.gate_proj`, ComfyUI's yak_mlp) with a text norm
(`txt_norm`); or diffusers' OvisImageTransformer2DModel names (`context_embedder_norm`) / folder."""
from __future__ import annotations

from typing import Optional

from ...checkpoints.header import Header
from ...checkpoints.loading import count_blocks, folder_entries, layout_keys, shape_of, two_layouts
from ...sp.tokens import rope_axes
from ..family import layout_detection
from ..flux.detection import ARCHITECTURE_KEYS, MLP_RATIO, shared_architecture

NAME = "ovis_image"
CLASS_NAME = "OvisImageTransformer2DModel"
ORIGINAL_ANCHORS = ("double_blocks.0.img_attn.norm.key_norm.scale", "img_in.weight", "txt_in.weight",
                    "time_in.in_layer.weight", "double_blocks.0.img_mlp.gate_proj.weight", "final_layer.linear.weight")
DIFFUSERS_ANCHORS = ("x_embedder.weight", "context_embedder_norm.weight", "timestep_embedder.linear_1.weight",
                     "transformer_blocks.0.attn.norm_added_k.weight", "proj_out.weight")
TEXT_NORMS = ("txt_norm.scale", "txt_norm.weight")
NOT_OVIS = ("vector_in.in_layer.weight", "guidance_in.in_layer.weight")  # Ovis-Image has neither
CONFIG_KEYS = ("patch_size", "in_channels", "out_channels", "num_layers", "num_single_layers", "attention_head_dim",
               "num_attention_heads", "joint_attention_dim", "axes_dims_rope")
MLP_KEYS = {"mlp": ("double_blocks.0.img_mlp.gate_proj.weight", "transformer_blocks.0.ff.net.0.proj.weight")}


def detect(header: Header):
    folder = folder_entries(header, CLASS_NAME, CONFIG_KEYS, {"axes_dims_rope": (16, 56, 56)}, ("axes_dims_rope",))
    found = two_layouts(header, folder, (ORIGINAL_ANCHORS, DIFFUSERS_ANCHORS), architecture)
    return layout_detection(header, NAME, found)


def architecture(keys: dict, layout: str) -> Optional[dict]:
    """OvisImageTransformer2DModel config from shapes (keys without prefix); ValueError for a SwiGLU Flux-layout file
    that is not Ovis-Image's (pooled text, guidance, no text norm, another MLP width)."""
    names = {**layout_keys(ARCHITECTURE_KEYS, layout), **layout_keys(MLP_KEYS, layout)}
    if layout == "original" and (any(key in keys for key in NOT_OVIS) or not any(k in keys for k in TEXT_NORMS)):
        raise ValueError("Flux-layout file with SwiGLU MLPs but not Ovis-Image's inputs (a pooled-text vector_in, a "
                         "guidance_in or no txt_norm): unsupported variant")
    config = shared_architecture(keys, names, "Ovis-Image")
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    mlp = shape_of(keys, names["mlp"])[0] // (1 if layout == "original" else 2)  # diffusers: [up; gate] in one
    fused = (3 + 2 * MLP_RATIO) * hidden
    single = shape_of(keys, "single_blocks.0.linear1.weight")[0] if layout == "original" and count_blocks(
        keys, "single_blocks") else fused
    if mlp != MLP_RATIO * hidden or single != fused:
        raise ValueError(f"Ovis-Image file with MLP width {mlp} and {single} fused single-block rows (width "
                         f"{hidden}: {MLP_RATIO * hidden} and {fused} expected): unsupported variant")
    return {**config, "axes_dims_rope": rope_axes(config["attention_head_dim"])}
