"""Lens detection from a header alone, as ComfyUI's model_detection tells it (image_model "lens"): Qwen-Image's
double-stream key names with fused q / k / v per stream (`attn.img_qkv`, `attn.txt_qkv`), SwiGLU MLPs (`img_mlp.w1`,
ComfyUI's GateMLP), RMS-normed blocks (`img_norm1.weight`) and a text of several encoder layers, each RMS-normed
(`txt_norm.0` ..). The model takes Flux.2's 128-channel latent one token per latent pixel: proj_out's rows are the
latent's channels (ComfyUI: 2 x 2 x out_channels)."""
from __future__ import annotations

from typing import Optional

from ...checkpoints.header import Header, header_config
from ...checkpoints.loading import count_blocks, find_prefix, shape_of, strip_prefix
from ...contract import Detection
from ...sp.tokens import rope_axes

NAME = "lens"
VARIANT = "lens"  # base and turbo share one architecture
CLASS_NAME = "QwenImageTransformer2DModel"  # diffusers' class at patch 1, its MLPs, norms and text norm rebuilt
DESCRIPTION = "Lens (base, turbo)"
ANCHORS = ("img_in.weight", "txt_in.weight", "txt_norm.0.weight", "transformer_blocks.0.attn.img_qkv.weight",
           "transformer_blocks.0.img_mlp.w1.weight", "proj_out.weight")
CONFIG_KEYS = ("patch_size", "in_channels", "out_channels", "num_layers", "attention_head_dim", "num_attention_heads",
               "joint_attention_dim", "axes_dims_rope")
LENS_KEYS = ("text_layers", "mlp_width")  # detection's entries loading.py reads (not diffusers' config)


def detect(header: Header) -> Optional[Detection]:
    """Lens from a ComfyUI file's header; None for another family's file; ValueError for a Lens variant the plan
    does not serve."""
    if header_config(header) is not None:
        return None
    prefix = find_prefix(header.tensors, ANCHORS[:2] + ANCHORS[3:])
    if prefix is None:
        return None
    keys = strip_prefix(header.tensors, prefix)
    return Detection(family=NAME, variant=VARIANT, layout="original", prefix=prefix, config=architecture(keys),
                     files=header.source.files)


def architecture(keys: dict) -> dict:
    """QwenImageTransformer2DModel config at patch 1 (plus LENS_KEYS) from header shapes (keys without prefix)."""
    if "txt_norm.0.weight" not in keys or "transformer_blocks.0.img_norm1.weight" not in keys:
        raise ValueError("Lens file with a single text layer (txt_norm.weight) or LayerNorm blocks (no "
                         "img_norm1.weight): unsupported variant (the released Lens files have 4 RMS-normed text "
                         "layers and RMS-normed blocks)")
    hidden, in_features = shape_of(keys, "img_in.weight")
    head_dim = shape_of(keys, "transformer_blocks.0.attn.norm_q.weight")[0]
    out_features = shape_of(keys, "proj_out.weight")[0]
    if hidden % head_dim or out_features != in_features:
        raise ValueError(f"Lens file of width {hidden}, head size {head_dim}, {in_features} input and {out_features} "
                         f"output features: unsupported variant (the width a multiple of the head size, proj_out "
                         f"giving back the latent's channels)")
    layers = count_blocks(keys, "txt_norm")
    text = shape_of(keys, "txt_norm.0.weight")[0]
    return {"patch_size": 1, "in_channels": in_features, "out_channels": out_features,
            "num_layers": count_blocks(keys, "transformer_blocks"), "attention_head_dim": head_dim,
            "num_attention_heads": hidden // head_dim, "joint_attention_dim": layers * text,
            "axes_dims_rope": rope_axes(head_dim), "text_layers": layers,
            "mlp_width": shape_of(keys, "transformer_blocks.0.img_mlp.w1.weight")[0]}
