"""Qwen-Image InstantX ControlNet (Union, Inpainting) detection from a header alone: diffusers'
QwenImageControlNetModel config. ComfyUI's loader (load_controlnet_qwen_instantx) keys on the same names."""
from __future__ import annotations

from typing import Optional

from ...checkpoints.header import Header
from ...checkpoints.loading import count_blocks, find_prefix, shape_of, strip_prefix
from ...contract import Detection
from ...sp.tokens import rope_axes

NAME = "qwen_image_controlnet"
ANCHORS = ("controlnet_blocks.0.weight", "controlnet_x_embedder.weight", "img_in.weight", "txt_in.weight",
           "transformer_blocks.0.img_mlp.net.0.proj.weight")
FUN_MARKER = "control_blocks.0.after_proj.weight"  # Qwen-Image 2512 Fun ControlNet Union: another architecture
CONFIG_KEYS = ("patch_size", "in_channels", "num_layers", "attention_head_dim", "num_attention_heads",
               "joint_attention_dim", "axes_dims_rope", "extra_condition_channels")


def detect(header: Header) -> Optional[Detection]:
    """The InstantX ControlNet; None for other files; the Fun ControlNet refused by name."""
    prefix = find_prefix(header.tensors, ANCHORS)
    if prefix is None:
        if find_prefix(header.tensors, (FUN_MARKER, "control_img_in.weight")) is not None:
            raise ValueError(f"{header.source.files[0]} is a Qwen-Image Fun ControlNet (2512 ControlNet Union); "
                             f"the pool serves the InstantX ControlNets (Union, Inpainting) only so far")
        return None
    keys = strip_prefix(header.tensors, prefix)
    return Detection(family=NAME, variant="instantx", layout="diffusers", prefix=prefix, config=architecture(keys),
                     files=header.source.files)


def architecture(keys: dict) -> dict:
    """QwenImageControlNetModel config from header shapes (keys without prefix)."""
    hidden, in_channels = shape_of(keys, "img_in.weight")
    head_dim = shape_of(keys, "transformer_blocks.0.attn.norm_q.weight")[0]
    return {"patch_size": 2, "in_channels": in_channels, "out_channels": in_channels // 4,
            "num_layers": count_blocks(keys, "transformer_blocks"), "attention_head_dim": head_dim,
            "num_attention_heads": hidden // head_dim, "joint_attention_dim": shape_of(keys, "txt_in.weight")[1],
            "axes_dims_rope": rope_axes(head_dim),
            "extra_condition_channels": shape_of(keys, "controlnet_x_embedder.weight")[1] - in_channels}
