"""JoyAI-Image-Edit detection from a header alone, as ComfyUI's model_detection tells it (a 5-D `img_in` Conv3d,
`double_blocks.N.attn.img_attn_qkv` with per-head q norms, `condition_embedder.time_embedder`): ComfyUI's files and
diffusers' JoyImageEdit(Plus)Transformer3DModel share these key names; a diffusers folder by its class. The heads, the
rotary split of the head ((16, 56, 56) at 128) and theta 10000 as ComfyUI's JoyImage sets them."""
from __future__ import annotations

import math
from typing import Optional

from ...checkpoints.header import Header, header_config
from ...checkpoints.loading import count_blocks, find_prefix, shape_of, strip_prefix
from ...contract import Detection
from ...sp.tokens import rope_axes

NAME = "joyimage"
DESCRIPTION = "JoyAI-Image-Edit"
CLASS_NAME = "JoyImageEditTransformer3DModel"  # its blocks run the plan (the Plus class: the reference's forward)
FOLDER_CLASSES = (CLASS_NAME, "JoyImageEditPlusTransformer3DModel")
THETA = 10000  # ComfyUI's supported_models.JoyImage (diffusers' class default: 256)
ANCHORS = ("double_blocks.0.attn.img_attn_qkv.weight", "double_blocks.0.attn.img_attn_q_norm.weight",
           "condition_embedder.time_embedder.linear_1.weight", "img_in.weight")
CONFIG_KEYS = ("patch_size", "in_channels", "out_channels", "hidden_size", "num_attention_heads", "text_dim",
               "mlp_width_ratio", "num_layers", "rope_dim_list", "theta")


def detect(header: Header) -> Optional[Detection]:
    """JoyAI-Image-Edit from its header; None for another family's file."""
    folder = header_config(header)
    if folder is not None:
        if folder.get("_class_name") not in FOLDER_CLASSES:
            return None
        config = {key: folder[key] for key in CONFIG_KEYS if key in folder}
        return Detection(family=NAME, variant="", layout="diffusers", prefix="", config=config,
                         files=header.source.files)
    prefix = find_prefix(header.tensors, ANCHORS)
    if prefix is None:
        return None
    keys = strip_prefix(header.tensors, prefix)
    if len(shape_of(keys, "img_in.weight")) != 5:
        return None
    return Detection(family=NAME, variant="", layout="diffusers", prefix=prefix, config=architecture(keys),
                     files=header.source.files)


def architecture(keys: dict) -> dict:
    """JoyImageEditTransformer3DModel config from shapes (keys without prefix) and ComfyUI's constants."""
    hidden, in_channels, *patch = shape_of(keys, "img_in.weight")
    head_dim = shape_of(keys, "double_blocks.0.attn.img_attn_q_norm.weight")[0]
    if hidden % head_dim:
        raise ValueError(f"JoyAI-Image-Edit width {hidden} is not a multiple of its head size {head_dim}")
    return {"patch_size": list(patch), "in_channels": in_channels,
            "out_channels": shape_of(keys, "proj_out.weight")[0] // math.prod(patch), "hidden_size": hidden,
            "num_attention_heads": hidden // head_dim,
            "text_dim": shape_of(keys, "condition_embedder.text_embedder.linear_1.weight")[1],
            "mlp_width_ratio": shape_of(keys, "double_blocks.0.img_mlp.net.0.proj.weight")[0] / hidden,
            "num_layers": count_blocks(keys, "double_blocks"), "rope_dim_list": list(rope_axes(head_dim)),
            "theta": THETA}
