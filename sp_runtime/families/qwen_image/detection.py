"""Qwen-Image detection from a header alone (no weights read, no diffusers): prefix, variant and the
QwenImageTransformer2DModel config. Qwen-Image, Edit and Edit-2509 share one architecture (the call decides);
Edit-2511 files carry ComfyUI's `__index_timestep_zero__` marker (diffusers folders: `zero_cond_t`), Layered files
`time_text_embed.addition_t_embedding`."""
from __future__ import annotations

from typing import Optional

from ...checkpoints.header import Header, header_config
from ...checkpoints.loading import count_blocks, find_prefix, shape_of, strip_prefix
from ...contract import Detection
from ...sp.tokens import rope_axes

NAME = "qwen_image"
PATCH = 2
ANCHORS = ("txt_norm.weight", "img_in.weight", "txt_in.weight", "transformer_blocks.0.attn.norm_q.weight",
           "proj_out.weight")
EDIT_2511_MARKER = "__index_timestep_zero__"  # ComfyUI's flag tensor in Qwen-Image-Edit-2511 files
LAYERED_MARKER = "time_text_embed.addition_t_embedding.weight"
REF_METHODS = ("index", "index_timestep_zero", "negative_index")  # others place references side by side
CONFIG_KEYS = ("patch_size", "in_channels", "out_channels", "num_layers", "attention_head_dim", "num_attention_heads",
               "joint_attention_dim", "axes_dims_rope", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope")
VARIANT_IMAGE = "image"         # Qwen-Image, Qwen-Image-Edit, Edit-2509 (one architecture)
VARIANT_EDIT_2511 = "edit_2511"  # reference tokens modulated with timestep 0 by default
VARIANT_LAYERED = "layered"     # Qwen-Image-Layered: additional_t_cond, layers as frames


def detect(header: Header) -> Optional[Detection]:
    """Qwen-Image from its header alone (no weights read); None when the file is another family."""
    folder_config = header_config(header)
    if folder_config is not None and folder_config.get("_class_name") != "QwenImageTransformer2DModel":
        return None
    prefix = find_prefix(header.tensors, ANCHORS)
    if prefix is None:
        return None
    keys = strip_prefix(header.tensors, prefix)
    config = _folder_config(folder_config) if folder_config else architecture(keys)
    if EDIT_2511_MARKER in keys:
        config["zero_cond_t"] = True
    if LAYERED_MARKER in keys:
        config["use_additional_t_cond"] = config["use_layer3d_rope"] = True
    variant = (VARIANT_LAYERED if config.get("use_additional_t_cond") else
               VARIANT_EDIT_2511 if config.get("zero_cond_t") else VARIANT_IMAGE)
    return Detection(family=NAME, variant=variant, layout="diffusers", prefix=prefix, config=config,
                     files=header.source.files)


def architecture(keys: dict) -> dict:
    """QwenImageTransformer2DModel config from header shapes (keys without prefix)."""
    hidden, in_features = shape_of(keys, "img_in.weight")
    head_dim = shape_of(keys, "transformer_blocks.0.attn.norm_q.weight")[0]
    if hidden % head_dim:
        raise ValueError(f"Qwen-Image width {hidden} is not a multiple of its head size {head_dim}")
    out_features = shape_of(keys, "proj_out.weight")[0]
    return {
        "patch_size": PATCH,
        "in_channels": in_features,
        "out_channels": out_features // (PATCH * PATCH),
        "num_layers": count_blocks(keys, "transformer_blocks"),
        "attention_head_dim": head_dim,
        "num_attention_heads": hidden // head_dim,
        "joint_attention_dim": shape_of(keys, "txt_in.weight")[1],
        "axes_dims_rope": rope_axes(head_dim),
        "zero_cond_t": False,
        "use_additional_t_cond": False,
        "use_layer3d_rope": False,
    }


def _folder_config(config: dict) -> dict:
    known = {key: config[key] for key in CONFIG_KEYS if key in config}
    for flag in ("zero_cond_t", "use_additional_t_cond", "use_layer3d_rope"):
        known.setdefault(flag, False)
    if "axes_dims_rope" in known:
        known["axes_dims_rope"] = tuple(known["axes_dims_rope"])
    return known
