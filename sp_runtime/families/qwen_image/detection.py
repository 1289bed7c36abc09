"""Qwen-Image detection from a header alone (no weights read, no diffusers): prefix, variant and the
QwenImageTransformer2DModel config. Qwen-Image, Edit and Edit-2509 share one architecture (the call decides);
Edit-2511 files carry ComfyUI's `__index_timestep_zero__` marker (diffusers folders: `zero_cond_t`), Layered files
`time_text_embed.addition_t_embedding`."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from ...checkpoints.header import Header
from ...checkpoints.loading import count_blocks, find_prefix, folder_entries, shape_of, strip_prefix
from ...contract import Detection
from ...sp.tokens import rope_axes
from ..family import with_rope_axes_option

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
    folder = folder_entries(header, "QwenImageTransformer2DModel", CONFIG_KEYS,
                            dict.fromkeys(("zero_cond_t", "use_additional_t_cond", "use_layer3d_rope"), False),
                            ("axes_dims_rope",))
    if folder == {}:  # a diffusers folder of another class
        return None
    prefix = find_prefix(header.tensors, ANCHORS)
    if prefix is None:
        return None
    keys = strip_prefix(header.tensors, prefix)
    from ..mage_flow.detection import is_mage_flow  # here: mage_flow's plan imports this package
    if not folder and is_mage_flow(keys):
        return None  # the same key names at Mage-Flow's widths (families/mage_flow)
    config = folder or architecture(keys)
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


def with_options(detection: Detection, options: dict) -> Detection:
    """Apply load options: variant="edit_2511" (files that cannot say so), axes_dims_rope (unusual head sizes)."""
    detection = with_rope_axes_option(detection, options)
    variant = options.get("variant") or detection.variant
    if variant not in (VARIANT_IMAGE, VARIANT_EDIT_2511, VARIANT_LAYERED):
        raise ValueError(f"Qwen-Image variant {variant!r} is unknown; use {VARIANT_IMAGE!r} or {VARIANT_EDIT_2511!r}")
    if (variant == VARIANT_LAYERED) != (detection.variant == VARIANT_LAYERED):
        raise ValueError(f"variant {variant!r} does not fit this {detection.variant!r} file: Qwen-Image-Layered is "
                         f"told by its weights (time_text_embed.addition_t_embedding), not by an option")
    return replace(detection, variant=variant, config={**detection.config, "zero_cond_t": variant == VARIANT_EDIT_2511})
