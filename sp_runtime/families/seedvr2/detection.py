"""SeedVR2 detection from a header alone (no weights read, no diffusers): the NaDiT keys of ComfyUI's files
(`vid_in.proj`, `blocks.N.attn.proj_qkv.vid / .all`, the stored prompt embeddings `positive_conditioning` /
`negative_conditioning`, which ComfyUI's SeedVR2 class requires). As ComfyUI's model_detection: the 3B (swiglu
MLPs, an output norm and modulation, the last block's text MLP left out, text-and-video rotary) and the 7B (3072
wide, video-only pixel rotary, every block whole); the 7B comes with separate `.vid` / `.txt` weights in every
block (GELU MLPs) or shared ones after block 10 (swiglu). Widths, heads, MLP size and the rotary's frequency count are
read from the shapes."""
from __future__ import annotations

from typing import Optional

from ...checkpoints.header import Header
from ...checkpoints.loading import count_blocks, find_prefix, shape_of, strip_prefix
from ...contract import Detection

NAME = "seedvr2"
DESCRIPTION = "SeedVR2 (3B, 7B)"
PATCH = (1, 2, 2)
LATENT_CHANNELS = 16  # x; the condition adds the 16 channels of the low-quality latent and a mask channel
WINDOWS = (4, 3, 3)  # windows per (frame, row, column) axis at 720p, every block (ComfyUI's NaDiT)
ANCHORS = ("vid_in.proj.weight", "emb_in.proj_in.weight", "vid_out.proj.weight", "positive_conditioning")
ROPE_KEY = "blocks.0.attn.rope.rope.freqs"  # the rotary's frequencies, when the file stores them
DEFAULT_FREQUENCIES = {"3b": 21, "7b": 10}  # per axis: 3B's rope_dim 128 -> 42 features; 7B's 64 -> 21 (10 pairs)
UNUSED = ("rope.rope.freqs",)
CONFIG_KEYS = ("variant", "vid_dim", "heads", "head_dim", "num_layers", "mm_layers", "mlp_type", "mlp_hidden",
               "txt_in_dim", "in_channels", "out_channels", "norm_eps", "rope_frequencies", "qk_bias")


def detect(header: Header) -> Optional[Detection]:
    """SeedVR2 from a ComfyUI file's header; None for another family's file."""
    prefix = find_prefix(header.tensors, ANCHORS)
    if prefix is None:
        return None
    keys = strip_prefix(header.tensors, prefix)
    config = architecture(keys)
    return Detection(family=NAME, variant=config["variant"], layout="original", prefix=prefix, config=config,
                     files=header.source.files)


def architecture(keys: dict) -> dict:
    """The model's config from header shapes (keys without prefix)."""
    dim, features = shape_of(keys, "vid_in.proj.weight")
    head_dim = shape_of(keys, _first(keys, "blocks.0.attn.norm_q", "weight"))[0]
    variant = "3b" if "vid_out_norm.weight" in keys else "7b"
    gated = _first(keys, "blocks.0.mlp", "proj_in_gate.weight", required=False)
    mlp = gated or _first(keys, "blocks.0.mlp", "proj_in.weight")
    if dim % head_dim:
        raise ValueError(f"SeedVR2 width {dim} is not a multiple of its head size {head_dim}")
    patch = PATCH[0] * PATCH[1] * PATCH[2]
    frequencies = shape_of(keys, ROPE_KEY)[0] if ROPE_KEY in keys else DEFAULT_FREQUENCIES[variant]
    return {"variant": variant, "vid_dim": dim, "heads": dim // head_dim, "head_dim": head_dim,
            "num_layers": count_blocks(keys, "blocks"),
            "mm_layers": sum(1 for key in keys if key.startswith("blocks.") and key.endswith(".attn.proj_qkv.vid.weight")),
            "mlp_type": "swiglu" if gated else "normal", "mlp_hidden": shape_of(keys, mlp)[0],
            "txt_in_dim": shape_of(keys, "txt_in.weight")[1], "in_channels": features // patch,
            "out_channels": shape_of(keys, "vid_out.proj.weight")[0] // patch, "norm_eps": 1e-5,
            "rope_frequencies": frequencies, "qk_bias": _first(keys, "blocks.0.attn.proj_qkv", "bias", False) is not None,
            "patch_size": PATCH, "positive_tokens": shape_of(keys, "positive_conditioning")[0],
            "negative_tokens": shape_of(keys, "negative_conditioning")[0]}


def _first(keys: dict, stem: str, leaf: str, required: bool = True) -> Optional[str]:
    """stem.vid.leaf or stem.all.leaf, whichever the file has."""
    for branch in ("vid", "all"):
        if f"{stem}.{branch}.{leaf}" in keys:
            return f"{stem}.{branch}.{leaf}"
    if required:
        raise ValueError(f"the checkpoint has no tensor {stem}.vid.{leaf} (or .all.): the SeedVR2 file is "
                         f"incomplete")
    return None
