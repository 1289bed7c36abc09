"""Z-Image detection from a header alone (no weights read, no diffusers): prefix, key layout (ComfyUI's fused qkv or
diffusers') and the ZImageTransformer2DModel config. Ming-Image (variant "ming_image") as ComfyUI's detection tells it:
a `__ming_image__` marker, `image_model: ming_image` in the file's config metadata, or no learned pad tokens (Ming-Image
Design: its caption is zero-padded to 32 and masked, which only moves the image positions: masked_pad_multiple)."""
from __future__ import annotations

from typing import Optional

from ...checkpoints.header import Header
from ...checkpoints.loading import count_blocks, find_prefix, folder_entries, shape_of, strip_prefix
from ...contract import Detection

NAME = "z_image"
CLASS_NAME = "ZImageTransformer2DModel"
PATCH = 2
PAD_MULTIPLE = 32            # ComfyUI's pad_tokens_multiple, diffusers' SEQ_MULTI_OF
ROPE_THETA = 256.0
AXES_LENS = (1536, 512, 512)  # rotary table sizes of diffusers' model (ComfyUI computes the angles directly)
ANCHORS = ("cap_embedder.1.weight", "t_embedder.mlp.0.weight", "noise_refiner.0.adaLN_modulation.0.weight",
           "context_refiner.0.attention_norm1.weight", "layers.0.feed_forward.w1.weight")
PAD_TOKENS = ("x_pad_token", "cap_pad_token")
MING_MARKER = "__ming_image__"
PIXEL_DECODER = "dec_net.cond_embed.weight"  # Z-Image's pixel-space variant (a DCT decoder head)
FUSED_QKV = ".attention.qkv.weight"     # ComfyUI's files: [q; k; v] rows in one tensor
UNUSED = ("norm_final.weight", "__ming_image__")  # unused by ComfyUI and diffusers; Ming-Image's marker
CONFIG_KEYS = ("in_channels", "dim", "n_layers", "n_refiner_layers", "n_heads", "n_kv_heads", "cap_feat_dim",
               "rope_theta", "t_scale", "axes_dims", "axes_lens")


def detect(header: Header) -> Optional[Detection]:
    """Z-Image from its header alone (no weights read); None when the file is another family."""
    folder = folder_entries(header, CLASS_NAME, CONFIG_KEYS + ("siglip_feat_dim",))
    if folder == {}:  # a diffusers folder of another class
        return None
    prefix = find_prefix(header.tensors, ANCHORS)
    if prefix is None:
        return None
    keys = strip_prefix(header.tensors, prefix)
    if any(key.startswith("siglip_") for key in keys) or (folder or {}).pop("siglip_feat_dim", None):
        raise ValueError(f"{header.path!r} is Z-Image Omni (SigLIP image features), which is not supported (Z-Image "
                         f"and Z-Image-Turbo load)")
    if PIXEL_DECODER in keys:
        raise ValueError(f"{header.path!r} is Z-Image pixel-space (a DCT decoder head, dec_net), which is not "
                         f"supported (Z-Image, Z-Image-Turbo and Ming-Image load)")
    missing = [name for name in PAD_TOKENS if name not in keys]
    ming = MING_MARKER in keys or _ming_metadata(header) or len(missing) == len(PAD_TOKENS)
    if missing and not (ming and len(missing) == len(PAD_TOKENS)):
        raise ValueError(f"{header.path!r} looks like Z-Image but has no {missing}: Z-Image pads its sequences with "
                         f"these learned tokens; the file is incomplete or another Lumina-type model")
    original = f"layers.0{FUSED_QKV}" in keys
    config = folder or architecture(keys, original)
    if ming:
        config = {**config, "masked_pad_multiple": PAD_MULTIPLE if missing else None}
    return Detection(family=NAME, variant="ming_image" if ming else "image",
                     layout="original" if original else "diffusers", prefix=prefix, config=config,
                     files=header.source.files)


def _ming_metadata(header: Header) -> bool:
    """`image_model: ming_image` under "transformer" in the file's `config` metadata (ComfyUI's repacked files)."""
    import json
    text = (header.metadata or {}).get("config")
    try:
        config = json.loads(text) if text else {}
    except ValueError:
        return False
    transformer = config.get("transformer") if isinstance(config, dict) else None
    return isinstance(transformer, dict) and transformer.get("image_model") == "ming_image"


def architecture(keys: dict, original: bool) -> dict:
    """ZImageTransformer2DModel config from header shapes (keys without prefix)."""
    dim, cap_feat_dim = shape_of(keys, "cap_embedder.1.weight")
    head_dim = shape_of(keys, "layers.0.attention." + ("q_norm" if original else "norm_q") + ".weight")[0]
    if dim % head_dim:
        raise ValueError(f"Z-Image width {dim} is not a multiple of its head size {head_dim}")
    key_rows = (shape_of(keys, f"layers.0{FUSED_QKV}")[0] - dim) // 2 if original else \
        shape_of(keys, "layers.0.attention.to_k.weight")[0]
    if key_rows != dim:
        raise ValueError(f"Z-Image with grouped key / value heads ({key_rows // head_dim} for {dim // head_dim} "
                         f"query heads) is not supported")
    hidden = shape_of(keys, "layers.0.feed_forward.w1.weight")[0]
    if hidden != int(dim / 3 * 8):  # diffusers' class fixes it
        raise ValueError(f"Z-Image feed-forward width {hidden} is not 8/3 of its width {dim} as diffusers' "
                         f"ZImageTransformer2DModel builds it; this variant is not supported")
    patch_features = shape_of(keys, ("x_embedder" if original else "all_x_embedder.2-1") + ".weight")[1]
    return {
        "all_patch_size": (PATCH,),
        "all_f_patch_size": (1,),
        "in_channels": patch_features // (PATCH * PATCH),
        "dim": dim,
        "n_layers": count_blocks(keys, "layers"),
        "n_refiner_layers": count_blocks(keys, "noise_refiner"),
        "n_heads": dim // head_dim,
        "n_kv_heads": dim // head_dim,
        "cap_feat_dim": cap_feat_dim,
        "rope_theta": ROPE_THETA,
        "t_scale": 1000.0,
        "axes_dims": z_image_axes(head_dim),
        "axes_lens": AXES_LENS,
    }


def z_image_axes(head_dim: int) -> tuple[int, int, int]:
    """Rotary dims of the (sequence, row, column) axes: (32, 48, 48) at the real head size 128 (checkpoints do not
    store them); other head sizes keep the proportions 1/4, 3/8, 3/8 (ComfyUI's 64-wide variant: 16, 24, 24)."""
    if head_dim % 16:
        raise ValueError(f"Z-Image head size {head_dim} cannot carry its rotary axes (needs a multiple of 16)")
    return head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8
