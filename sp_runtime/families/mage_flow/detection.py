"""Mage-Flow detection from a header alone (no weights read, no diffusers): Qwen-Image's key names and blocks at
patch 1 on Flux.2's 128-channel latent, with Qwen3-VL 4B's 2560-wide text; ComfyUI tells it from Qwen-Image by
exactly these two widths (txt_norm 2560, proj_out 128 rows), and so do we."""
from __future__ import annotations

from typing import Optional

from ...checkpoints.header import Header, header_config
from ...checkpoints.loading import count_blocks, find_prefix, shape_of, strip_prefix
from ...contract import Detection
from ...sp.tokens import rope_axes

NAME = "mage_flow"
VARIANT = "mage_flow"  # base, turbo and edit share one architecture (edit: reference latents in the call)
CLASS_NAME = "QwenImageTransformer2DModel"  # diffusers' class at patch 1 holds every weight
DESCRIPTION = "Mage-Flow (base, turbo, edit)"
TEXT_WIDTH = 2560  # Qwen3-VL 4B's hidden size (Qwen-Image's txt_norm: 3584)
LATENT_CHANNELS = 128  # Flux.2's latent, one token per latent pixel (Qwen-Image's proj_out: 64 rows)
ANCHORS = ("txt_norm.weight", "img_in.weight", "txt_in.weight", "transformer_blocks.0.attn.norm_q.weight",
           "proj_out.weight")
CONFIG_KEYS = ("patch_size", "in_channels", "out_channels", "num_layers", "attention_head_dim", "num_attention_heads",
               "joint_attention_dim", "axes_dims_rope")


def is_mage_flow(keys: dict) -> bool:
    """ComfyUI's test (model_detection: txt_norm 2560 wide, proj_out of 128 rows) on keys without prefix."""
    return (shape_of(keys, "txt_norm.weight")[0] == TEXT_WIDTH
            and shape_of(keys, "proj_out.weight")[0] == LATENT_CHANNELS)


def detect(header: Header) -> Optional[Detection]:
    """Mage-Flow from a ComfyUI file's header; None for another family's file (diffusers folders: none released)."""
    if header_config(header) is not None:
        return None
    prefix = find_prefix(header.tensors, ANCHORS)
    if prefix is None:
        return None
    keys = strip_prefix(header.tensors, prefix)
    if not is_mage_flow(keys):
        return None
    return Detection(family=NAME, variant=VARIANT, layout="diffusers", prefix=prefix, config=architecture(keys),
                     files=header.source.files)


def architecture(keys: dict) -> dict:
    """QwenImageTransformer2DModel config at patch 1 from header shapes (ComfyUI's MageFlowTransformer2DModel)."""
    hidden, in_features = shape_of(keys, "img_in.weight")
    head_dim = shape_of(keys, "transformer_blocks.0.attn.norm_q.weight")[0]
    if hidden % head_dim:
        raise ValueError(f"Mage-Flow width {hidden} is not a multiple of its head size {head_dim}")
    return {"patch_size": 1, "in_channels": in_features, "out_channels": shape_of(keys, "proj_out.weight")[0],
            "num_layers": count_blocks(keys, "transformer_blocks"), "attention_head_dim": head_dim,
            "num_attention_heads": hidden // head_dim, "joint_attention_dim": shape_of(keys, "txt_in.weight")[1],
            "axes_dims_rope": rope_axes(head_dim)}
