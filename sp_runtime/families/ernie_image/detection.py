"""ERNIE-Image detection from a header alone, as ComfyUI's model_detection tells it (`layers.0.mlp.linear_fc2.weight`):
ComfyUI names the weights as diffusers' ErnieImageTransformer2DModel does (with or without `model.diffusion_model.`),
diffusers folders carry config.json. Sizes from the shapes; ComfyUI's fixed rotary (theta 256, axes (32, 48, 48) of
a head of 128)."""
from __future__ import annotations

from typing import Optional

from ...checkpoints.header import Header
from ...checkpoints.loading import count_blocks, folder_entries, shape_of, two_layouts
from ..family import layout_detection

NAME = "ernie_image"
DESCRIPTION = "ERNIE-Image (and Turbo)"
CLASS_NAME = "ErnieImageTransformer2DModel"
ROPE_THETA = 256
ROPE_AXES = (32, 48, 48)  # ComfyUI's ErnieImageModel: fixed, for its head size of 128
ANCHORS = ("layers.0.mlp.linear_fc2.weight", "x_embedder.proj.weight", "adaLN_modulation.1.weight")
CONFIG_KEYS = ("hidden_size", "num_attention_heads", "num_layers", "ffn_hidden_size", "in_channels", "out_channels",
               "patch_size", "text_in_dim", "rope_theta", "rope_axes_dim", "eps", "qk_layernorm")


def detect(header: Header):
    folder = folder_entries(header, CLASS_NAME, CONFIG_KEYS, tuples=("rope_axes_dim",))
    found = two_layouts(header, folder, (ANCHORS, ANCHORS), lambda keys, layout: architecture(keys))
    return layout_detection(header, NAME, found)


def architecture(keys: dict) -> Optional[dict]:
    """ErnieImageTransformer2DModel config from header shapes (keys without prefix)."""
    hidden, in_channels, patch, _ = shape_of(keys, "x_embedder.proj.weight")
    head_dim = shape_of(keys, "layers.0.self_attention.norm_q.weight")[0]
    if head_dim != sum(ROPE_AXES) or hidden % head_dim:
        raise ValueError(f"ERNIE-Image width {hidden} with heads of {head_dim}: ComfyUI's ERNIE-Image has heads of "
                         f"{sum(ROPE_AXES)} (its fixed rotary axes {ROPE_AXES})")
    text_in = shape_of(keys, "text_proj.weight")[1] if "text_proj.weight" in keys else hidden
    return {"hidden_size": hidden, "num_attention_heads": hidden // head_dim,
            "num_layers": count_blocks(keys, "layers"),
            "ffn_hidden_size": shape_of(keys, "layers.0.mlp.gate_proj.weight")[0], "in_channels": in_channels,
            "out_channels": shape_of(keys, "final_linear.weight")[0] // (patch * patch), "patch_size": patch,
            "text_in_dim": text_in, "rope_theta": ROPE_THETA, "rope_axes_dim": ROPE_AXES, "eps": 1e-6,
            "qk_layernorm": True}
