"""LTX-Video 0.9 detection from a header alone, as ComfyUI's model_detection tells it ("ltxv":
`adaln_single.emb.timestep_embedder.linear_1.bias` without PixArt's `pos_embed` nor LTX-2's audio stream): 32 heads
of to_k rows / 32 unless the file's `config` metadata (section "transformer") states them, and the release settings
ComfyUI reads there (causal_temporal_positioning, timestep_scale_multiplier). Settings of later LTX releases that
ComfyUI's LTXV model reads but diffusers' LTXVideoTransformer3DModel lacks are refused by name."""
from __future__ import annotations

import json
from typing import Optional

from ...checkpoints.header import Header
from ...checkpoints.loading import count_blocks, folder_entries, layout_keys, shape_of, two_layouts
from ...contract import Detection

NAME = "ltxv"
DESCRIPTION = "LTX-Video 0.9 (text / image to video)"
CLASS_NAME = "LTXVideoTransformer3DModel"
HEADS = 32          # ComfyUI's LTXV default: the head size is to_k's rows / 32
MAX_POS = [20, 2048, 2048]
# fact -> (ComfyUI's key, diffusers' key)
KEYS = {"embed": ("patchify_proj.weight", "proj_in.weight"),
        "time": ("adaln_single.emb.timestep_embedder.linear_1.bias", "time_embed.emb.timestep_embedder.linear_1.bias"),
        "norm_q": ("transformer_blocks.0.attn1.q_norm.weight", "transformer_blocks.0.attn1.norm_q.weight")}
ANCHORS = tuple(tuple(keys[index] for keys in KEYS.values()) + ("caption_projection.linear_1.weight",
                                                                "transformer_blocks.0.scale_shift_table")
                for index in (0, 1))
NOT_LTXV = ("pos_embed.proj.bias", "audio_adaln_single.linear.weight", "audio_proj_in.weight")  # PixArt, LTX-2
CONFIG_KEYS = ("in_channels", "out_channels", "num_attention_heads", "attention_head_dim", "cross_attention_dim",
               "num_layers", "caption_channels", "causal_temporal_positioning", "timestep_scale_multiplier")
# release settings ComfyUI's LTXV model reads -> the value diffusers' class computes with, and what another means
REFUSED_SETTINGS = {"rope_type": ("interleaved", "split rotary"),
                    "frequencies_precision": ("float32", "float64 rotary frequencies"),
                    "use_middle_indices_grid": (False, "rotary positions at token middles"),
                    "cross_attention_adaln": (False, "prompt AdaLN"),
                    "caption_proj_before_connector": (False, "a caption projection before text connectors"),
                    "positional_embedding_max_pos": (MAX_POS, "other rotary position ranges")}
REFUSED_KEYS = {"keyframes_abs_pos_embedding": "a keyframe position embedding",
                "transformer_blocks.0.prompt_scale_shift_table": "prompt AdaLN"}


def detect(header: Header) -> Optional[Detection]:
    """LTX-Video 0.9 from its header alone; None when the file is another family."""
    release = release_settings(header)
    folder = folder_entries(header, CLASS_NAME, CONFIG_KEYS, {"causal_temporal_positioning": False,
                                                              "timestep_scale_multiplier": 1000.0})
    found = two_layouts(header, folder, ANCHORS, lambda keys, layout: architecture(header, keys, layout, release))
    if found is None:
        return None
    layout, prefix, config = found
    return Detection(family=NAME, variant="", layout=layout, prefix=prefix, config=config, files=header.source.files)


def release_settings(header: Header) -> dict:
    """The `transformer` section of the file's `config` metadata (ComfyUI updates its detection with it)."""
    text = header.metadata.get("config")
    if not text:
        return {}
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{header.path!r}: its 'config' metadata is not JSON ({error})") from None
    return parsed.get("transformer", {}) if isinstance(parsed, dict) else {}


def architecture(header: Header, keys: dict, layout: str, release: dict) -> Optional[dict]:
    """LTXVideoTransformer3DModel config from shapes and the release settings (keys without prefix)."""
    if any(key in keys for key in NOT_LTXV):
        return None
    _refuse(header, keys, release)
    name = layout_keys(KEYS, layout)
    inner, in_channels = shape_of(keys, name["embed"])
    heads = int(release.get("num_attention_heads", HEADS))
    head_dim = int(release.get("attention_head_dim", inner // HEADS))
    if heads * head_dim != inner:
        raise ValueError(f"{header.path!r}: LTX-Video width {inner} is not {heads} heads of {head_dim}; the file's "
                         f"'config' metadata must state num_attention_heads and attention_head_dim")
    return {"in_channels": in_channels, "out_channels": shape_of(keys, "proj_out.weight")[0],
            "num_attention_heads": heads, "attention_head_dim": head_dim,
            "cross_attention_dim": shape_of(keys, "transformer_blocks.0.attn2.to_k.weight")[1],
            "num_layers": count_blocks(keys, "transformer_blocks"),
            "caption_channels": shape_of(keys, "caption_projection.linear_1.weight")[1],
            "causal_temporal_positioning": bool(release.get("causal_temporal_positioning", False)),
            "timestep_scale_multiplier": float(release.get("timestep_scale_multiplier", 1000.0))}


def _refuse(header: Header, keys: dict, release: dict) -> None:
    for setting, (served, what) in REFUSED_SETTINGS.items():
        if setting in release and release[setting] != served:
            raise ValueError(f"{header.path!r} is an LTX model with {what} ({setting}={release[setting]!r}), which "
                             f"diffusers' LTX-Video class does not compute: not supported (LTX-Video 0.9 files load)")
    for key, what in REFUSED_KEYS.items():
        if key in keys:
            raise ValueError(f"{header.path!r} is an LTX model with {what} ({key}), which diffusers' LTX-Video "
                             f"class lacks: not supported (LTX-Video 0.9 files load)")
