"""Kandinsky 5 detection from a header alone, as ComfyUI's model_detection tells it
(`visual_transformer_blocks.0.cross_attention.key_norm.weight`): the release's key names are diffusers'
(Kandinsky5Transformer3DModel); the rotary axes follow from the width as ComfyUI fixes them (4096 and 2560 wide:
(32, 48, 48); else (16, 24, 24)), the position scale too (2560, Lite image: 1; else 2 in rows and columns). Files
whose input takes only the latent are the image model (ComfyUI's Kandinsky5Image, 4-D latents), the others the
video model (latent, image latent and mask channels: text and image to video). Sparse (NABLA) attention is a
pipeline setting, not in the file: the model runs full attention, as ComfyUI's does."""
from __future__ import annotations

from typing import Optional

from ...checkpoints.header import Header
from ...checkpoints.loading import count_blocks, find_prefix, folder_entries, shape_of, strip_prefix
from ...contract import Detection

NAME = "kandinsky5"
DESCRIPTION = "Kandinsky 5 (Lite / Pro text to image, text and image to video)"
CLASS_NAME = "Kandinsky5Transformer3DModel"
PATCH = (1, 2, 2)
ANCHORS = ("visual_transformer_blocks.0.cross_attention.key_norm.weight", "visual_embeddings.in_layer.weight",
           "time_embeddings.in_layer.bias", "text_transformer_blocks.0.self_attention.to_query.weight")
CONFIG_KEYS = ("in_visual_dim", "in_text_dim", "in_text_dim2", "time_dim", "out_visual_dim", "patch_size",
               "model_dim", "ff_dim", "num_text_blocks", "num_visual_blocks", "axes_dims", "visual_cond",
               "rope_scale_factor")
WIDE_AXES = (32, 48, 48)      # ComfyUI: the 4096 (Pro video) and 2560 (Lite image) wide models
AXES = (16, 24, 24)


def detect(header: Header) -> Optional[Detection]:
    folder = folder_entries(header, CLASS_NAME, CONFIG_KEYS, tuples=("patch_size", "axes_dims", "rope_scale_factor"))
    if folder is not None:
        if not folder:
            return None
        config = {"rope_scale_factor": rope_scale_factor(folder["model_dim"]), **folder}
        return _detection(header, "", config)
    prefix = find_prefix(header.tensors, ANCHORS)
    if prefix is None:
        return None
    return _detection(header, prefix, architecture(strip_prefix(header.tensors, prefix)))


def _detection(header: Header, prefix: str, config: dict) -> Detection:
    return Detection(family=NAME, variant="video" if config["visual_cond"] else "image", layout="diffusers",
                     prefix=prefix, config=config, files=header.source.files)


def architecture(keys: dict) -> dict:
    """Kandinsky5Transformer3DModel config from shapes (keys without prefix) and ComfyUI's width rules."""
    model_dim, features = shape_of(keys, "visual_embeddings.in_layer.weight")
    out_visual_dim = shape_of(keys, "out_layer.out_layer.weight")[0] // (PATCH[1] * PATCH[2])
    channels = features // (PATCH[1] * PATCH[2])
    visual_cond = channels != out_visual_dim
    if visual_cond and channels != 2 * out_visual_dim + 1:
        raise ValueError(f"a Kandinsky 5 model taking {channels} latent channels (its output has {out_visual_dim}): "
                         f"neither the image model ({out_visual_dim}) nor the video model "
                         f"({2 * out_visual_dim + 1}: latent, image latent, mask); not supported")
    axes = WIDE_AXES if model_dim in (4096, 2560) else AXES
    if model_dim % sum(axes):
        raise ValueError(f"Kandinsky 5 width {model_dim} is not whole heads of {sum(axes)} (ComfyUI's head size "
                         f"for this width)")
    return {"in_visual_dim": out_visual_dim, "out_visual_dim": out_visual_dim, "visual_cond": visual_cond,
            "in_text_dim": shape_of(keys, "text_embeddings.in_layer.weight")[1],
            "in_text_dim2": shape_of(keys, "pooled_text_embeddings.in_layer.weight")[1],
            "time_dim": shape_of(keys, "time_embeddings.in_layer.bias")[0], "patch_size": PATCH,
            "model_dim": model_dim,
            "ff_dim": shape_of(keys, "visual_transformer_blocks.0.feed_forward.in_layer.weight")[0],
            "num_text_blocks": count_blocks(keys, "text_transformer_blocks"),
            "num_visual_blocks": count_blocks(keys, "visual_transformer_blocks"), "axes_dims": axes,
            "rope_scale_factor": rope_scale_factor(model_dim)}


def rope_scale_factor(model_dim: int) -> tuple[float, float, float]:
    """ComfyUI's position scale (frames, rows, columns): none for the 2560 wide Lite image model."""
    return (1.0, 1.0, 1.0) if model_dim == 2560 else (1.0, 2.0, 2.0)
