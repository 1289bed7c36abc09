"""Boogu-Image (base, turbo, edit) detection from a header alone (no weights read, no diffusers): ComfyUI's key names
(OmniGen2's blocks plus `double_stream_layers`), with or without `model.diffusion_model.`; the config of the model
modules.build_model makes (diffusers' Lumina2 model and the Boogu modules it lacks)."""
from __future__ import annotations

from typing import Optional

from ...checkpoints.header import Header, header_config
from ...checkpoints.loading import count_blocks, find_prefix, shape_of, strip_prefix
from ...contract import Detection

NAME = "boogu"
VARIANT = "image"  # base, turbo and edit share one architecture (edit: reference latents in the call)
DESCRIPTION = "Boogu-Image (base, turbo, edit)"
CLASS_NAME = "Lumina2Transformer2DModel"  # diffusers' model holding the embedders, refiners, single blocks, head
PATCH = 2
ROPE_THETA = 10000.0
MULTIPLE_OF = 256          # feed-forward width: 4 x width rounded up to this (ComfyUI's default, never read from a file)
TIMESTEP_SCALE = 1000.0    # ComfyUI's BooguTransformer2DModel default: sinusoids of (1 - sigma) x 1000
AXES_LENS = (2048, 1664, 1664)
ANCHORS = ("double_stream_layers.0.img_instruct_attn.processor.img_to_q.weight", "x_embedder.weight",
           "time_caption_embed.caption_embedder.1.weight", "single_stream_layers.0.attn.norm_q.weight",
           "single_stream_layers.0.attn.to_k.weight", "single_stream_layers.0.feed_forward.linear_1.weight")
CONFIG_KEYS = ("in_channels", "hidden_size", "num_layers", "num_refiner_layers", "num_attention_heads",
               "num_kv_heads", "cap_feat_dim", "axes_dim_rope", "multiple_of")
LUMINA2_KEYS = (*CONFIG_KEYS, "patch_size", "ffn_dim_multiplier", "norm_eps", "axes_lens")


def detect(header: Header) -> Optional[Detection]:
    """Boogu-Image from a ComfyUI file's header (ComfyUI's test: a double-stream block's img_to_q); None for another
    family's file (no diffusers folder is released)."""
    if header_config(header) is not None:
        return None
    prefix = find_prefix(header.tensors, ANCHORS)
    if prefix is None:
        return None
    try:
        config = architecture(strip_prefix(header.tensors, prefix))
    except ValueError as error:
        raise ValueError(f"{header.path!r}: {error}") from None
    return Detection(family=NAME, variant=VARIANT, layout="original", prefix=prefix, config=config,
                     files=header.source.files)


def architecture(keys: dict) -> dict:
    """The model's config from header shapes: widths and block counts as ComfyUI's detection reads them; the head
    size from the q norm and the key / value heads from to_k (ComfyUI fixes 28 heads over 7, what the released
    file's shapes say)."""
    hidden, patch_features = shape_of(keys, "x_embedder.weight")
    head_dim = shape_of(keys, "single_stream_layers.0.attn.norm_q.weight")[0]
    if hidden % head_dim or head_dim % 6:
        raise ValueError(f"Boogu-Image width {hidden} with head size {head_dim}: the width must be whole heads and "
                         f"the head size carry three even rotary axes")
    heads, kv_heads = hidden // head_dim, shape_of(keys, "single_stream_layers.0.attn.to_k.weight")[0] // head_dim
    if heads % kv_heads:
        raise ValueError(f"Boogu-Image with {heads} query heads over {kv_heads} key / value heads is not supported")
    feed_forward = shape_of(keys, "single_stream_layers.0.feed_forward.linear_1.weight")[0]
    if feed_forward != -(-4 * hidden // MULTIPLE_OF) * MULTIPLE_OF:
        raise ValueError(f"Boogu-Image feed-forward width {feed_forward} is not 4 x {hidden} rounded up to "
                         f"{MULTIPLE_OF} as ComfyUI builds it; this variant is not supported")
    return {"patch_size": PATCH, "in_channels": patch_features // (PATCH * PATCH), "hidden_size": hidden,
            "num_layers": count_blocks(keys, "single_stream_layers"),
            "num_double_stream_layers": count_blocks(keys, "double_stream_layers"),
            "num_refiner_layers": count_blocks(keys, "noise_refiner"), "num_attention_heads": heads,
            "num_kv_heads": kv_heads, "multiple_of": MULTIPLE_OF, "ffn_dim_multiplier": None, "norm_eps": 1e-5,
            "cap_feat_dim": shape_of(keys, "time_caption_embed.caption_embedder.0.weight")[0],
            "axes_dim_rope": (head_dim // 3,) * 3, "axes_lens": AXES_LENS}
