"""Lumina 2 (NextDiT: Lumina-Image 2.0, NetaYume, NewBie) detection from a header alone: prefix, key layout (ComfyUI's
fused qkv or diffusers') and the Lumina2Transformer2DModel config; NewBie (variant "newbie") adds the width of its
pooled CLIP text (clip_text_dim), as ComfyUI's detection reads it from clip_text_pooled_proj."""
from __future__ import annotations

from typing import Optional

from ...checkpoints.header import Header
from ...checkpoints.loading import count_blocks, find_layout, folder_entries, shape_of
from ...contract import Detection

NAME = "lumina2"
CLASS_NAME = "Lumina2Transformer2DModel"
PATCH = 2
ROPE_THETA = 10000.0
AXES_LENS = (300, 512, 512)   # diffusers' rotary table sizes (ComfyUI computes the angles directly)
MULTIPLE_OF = 256             # feed-forward width: 4 x dim rounded up to this (ComfyUI's and diffusers' default)
ORIGINAL_ANCHORS = ("cap_embedder.1.weight", "t_embedder.mlp.0.weight", "noise_refiner.0.adaLN_modulation.1.weight",
                    "layers.0.attention.qkv.weight", "layers.0.feed_forward.w1.weight")
DIFFUSERS_ANCHORS = ("time_caption_embed.caption_embedder.1.weight", "noise_refiner.0.norm1.linear.weight",
                     "layers.0.attn.to_k.weight", "layers.0.feed_forward.linear_1.weight")
UNUSED = ("norm_final.weight",)  # in the original release, used by neither ComfyUI nor diffusers
CONFIG_KEYS = ("in_channels", "hidden_size", "num_layers", "num_refiner_layers", "num_attention_heads",
               "num_kv_heads", "cap_feat_dim", "axes_dim_rope", "axes_lens", "multiple_of", "ffn_dim_multiplier")
NEWBIE_KEY = "clip_text_pooled_proj.0.weight"  # NewBie: its pooled Jina CLIP text joins the time embedding
NEWBIE_KEYS = ("clip_text_pooled_proj.0.weight", "clip_text_pooled_proj.1.weight", "clip_text_pooled_proj.1.bias",
               "time_text_embed.1.weight", "time_text_embed.1.bias")
REFUSED = {"__ming_image__": "Ming-Image's marker on a Lumina 2-sized model (ComfyUI's Ming-Image is Z-Image-sized)"}


def detect(header: Header) -> Optional[Detection]:
    """Lumina 2 from its header alone (no weights read); None when the file is another family."""
    folder = folder_entries(header, CLASS_NAME, CONFIG_KEYS, tuples=("axes_dim_rope", "axes_lens"))
    if folder == {}:  # a diffusers folder of another class
        return None
    found = find_layout(header, ORIGINAL_ANCHORS, DIFFUSERS_ANCHORS)
    if found is None:
        return None
    layout, prefix, keys = found
    if "ref_image_patch_embedder.weight" in keys:  # OmniGen2 / Boogu-Image: Lumina 2's names plus their own
        return None
    for key, what in REFUSED.items():
        if key in keys:
            raise ValueError(f"{header.path!r} is {what}: not supported (Lumina-Image 2.0 and NetaYume load)")
    config = folder or architecture(keys, layout == "original")
    newbie = NEWBIE_KEY in keys
    if newbie:
        config = {**config, "clip_text_dim": newbie_width(header, keys, config)}
    return Detection(family=NAME, variant="newbie" if newbie else "image", layout=layout, prefix=prefix,
                     config=config, files=header.source.files)


def newbie_width(header: Header, keys: dict, config: dict) -> int:
    """NewBie's pooled-text width: clip_text_pooled_proj (RMSNorm, Linear width -> width) and time_text_embed (SiLU,
    Linear time + width -> time); ValueError naming the file when a part is missing or of another size (the biases
    are read: a quantized file may store its matrices packed)."""
    width = shape_of(keys, NEWBIE_KEY)[0]
    biases = {"clip_text_pooled_proj.1.bias": (width,), "time_text_embed.1.bias": (min(config["hidden_size"], 1024),)}
    missing = [key for key in NEWBIE_KEYS if key not in keys]
    wrong = [key for key, shape in biases.items() if key in keys and tuple(shape_of(keys, key)) != shape]
    if missing or wrong:
        raise ValueError(f"{header.path!r} looks like NewBie (pooled text of width {width}) but has "
                         f"{'no ' + str(missing) if missing else ''}{' and ' if missing and wrong else ''}"
                         f"{'a ' + str(wrong) + ' of another size' if wrong else ''}: the file is incomplete")
    return width


def architecture(keys: dict, original: bool) -> dict:
    """Lumina2Transformer2DModel config from header shapes (keys without prefix)."""
    caption = "cap_embedder.1.weight" if original else "time_caption_embed.caption_embedder.1.weight"
    dim, cap_feat_dim = shape_of(keys, caption)
    head_dim = shape_of(keys, "layers.0.attention.q_norm.weight" if original else "layers.0.attn.norm_q.weight")[0]
    if dim % head_dim or head_dim % 6:
        raise ValueError(f"Lumina 2 width {dim} with head size {head_dim}: the width must be whole heads and the "
                         f"head size carry three even rotary axes")
    key_rows = (shape_of(keys, "layers.0.attention.qkv.weight")[0] - dim) // 2 if original else \
        shape_of(keys, "layers.0.attn.to_k.weight")[0]
    heads, kv_heads = dim // head_dim, key_rows // head_dim
    if heads % kv_heads:
        raise ValueError(f"Lumina 2 with {heads} query heads over {kv_heads} key / value heads is not supported")
    hidden = shape_of(keys, "layers.0.feed_forward." + ("w1" if original else "linear_1") + ".weight")[0]
    if hidden != -(-4 * dim // MULTIPLE_OF) * MULTIPLE_OF:
        raise ValueError(f"Lumina 2 feed-forward width {hidden} is not 4 x {dim} rounded up to {MULTIPLE_OF} as "
                         f"ComfyUI's and diffusers' NextDiT build it; this variant is not supported")
    patch_features = shape_of(keys, "x_embedder.weight")[1]
    return {
        "patch_size": PATCH,
        "in_channels": patch_features // (PATCH * PATCH),
        "hidden_size": dim,
        "num_layers": count_blocks(keys, "layers"),
        "num_refiner_layers": count_blocks(keys, "noise_refiner"),
        "num_attention_heads": heads,
        "num_kv_heads": kv_heads,
        "multiple_of": MULTIPLE_OF,
        "ffn_dim_multiplier": None,
        "cap_feat_dim": cap_feat_dim,
        "axes_dim_rope": (head_dim // 3,) * 3,  # (32, 32, 32) at the released head size 96, as ComfyUI fixes it
        "axes_lens": AXES_LENS,
    }
