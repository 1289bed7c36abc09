"""Qwen-Image 2.1 detection from a header alone (no weights read, no diffusers): prefix, key layout (ComfyUI's fused
SwiGLU input or diffusers') and the QwenImage21Transformer2DModel config."""
from __future__ import annotations

from typing import Optional

from ...checkpoints.header import Header
from ...checkpoints.loading import count_blocks, find_prefix, folder_entries, shape_of, strip_prefix
from ...contract import Detection
from ...sp.tokens import rope_axes

NAME = "qwen_image21"
ANCHORS = ("img_in.weight", "txt_in.in_layer.weight", "txt_in.text_norm.weight", "modulation.1.weight",
           "transformer_blocks.0.attn.norm_q.weight", "norm_out.linear.weight", "proj_out.weight")
FUSED_MLP = "img_mlp.gate_up"  # ComfyUI's files: [gate; up] rows in one tensor, diffusers' gate_layer and proj
CONFIG_KEYS = ("patch_size", "in_channels", "out_channels", "num_layers", "attention_head_dim", "num_attention_heads",
               "context_in_dim", "mlp_ratio", "axes_dims_rope", "causal_condition")
CLASS_NAME = "QwenImage21Transformer2DModel"


def detect(header: Header) -> Optional[Detection]:
    """Qwen-Image 2.1 from its header alone (no weights read); None when the file is another family."""
    folder = folder_entries(header, CLASS_NAME, CONFIG_KEYS, {"axes_dims_rope": (16, 56, 56)}, ("axes_dims_rope",))
    if folder == {}:  # a diffusers folder of another class
        return None
    prefix = find_prefix(header.tensors, ANCHORS)
    if prefix is None:
        return None
    keys = strip_prefix(header.tensors, prefix)
    fused = f"transformer_blocks.0.{FUSED_MLP}.weight" in keys
    return Detection(family=NAME, variant="image", layout="original" if fused else "diffusers", prefix=prefix,
                     config=folder or architecture(keys, fused), files=header.source.files)


def architecture(keys: dict, fused: bool) -> dict:
    """QwenImage21Transformer2DModel config from header shapes (keys without prefix)."""
    hidden, in_channels = shape_of(keys, "img_in.weight")
    head_dim = shape_of(keys, "transformer_blocks.0.attn.norm_q.weight")[0]
    if hidden % head_dim:
        raise ValueError(f"Qwen-Image 2.1 width {hidden} is not a multiple of its head size {head_dim}")
    mlp_rows = (shape_of(keys, f"transformer_blocks.0.{FUSED_MLP}.weight")[0] // 2 if fused
                else shape_of(keys, "transformer_blocks.0.img_mlp.proj.weight")[0])
    if mlp_rows % hidden:
        raise ValueError(f"Qwen-Image 2.1 MLP width {mlp_rows} is not a multiple of its width {hidden}")
    return {
        "patch_size": 1,
        "in_channels": in_channels,
        "out_channels": shape_of(keys, "proj_out.weight")[0],
        "num_layers": count_blocks(keys, "transformer_blocks"),
        "attention_head_dim": head_dim,
        "num_attention_heads": hidden // head_dim,
        "context_in_dim": shape_of(keys, "txt_in.in_layer.weight")[1],
        "mlp_ratio": mlp_rows // hidden,
        "axes_dims_rope": rope_axes(head_dim),
        "causal_condition": True,
    }
