"""Wan 2.1 / 2.2 checkpoints from the header alone: key layout (original / ComfyUI or diffusers), variant and the
diffusers config; variants add their facts through the registry (wan.variants). No torch or diffusers import here:
detection runs in the ComfyUI process."""
from __future__ import annotations

import json
import math
from typing import Optional

from ...contract import Detection
from ...checkpoints.loading import count_blocks, find_prefix, layout_keys, shape_of, strip_prefix
from ...checkpoints.header import Header, header_config
from ..family import layout_detection
from .keys import original_key, wan_key_plan
from .variants import REGISTRY

FAMILY = "wan"
DEFAULT_HEAD_DIM = 128  # every released Wan model; q/k norms span all heads, so no checkpoint shows it
HEAD_DIM_METADATA_KEY = "ulysses_sp.head_dim"  # our tiny test checkpoints state theirs here
DIFFUSERS_CLASS = "WanTransformer3DModel"
ORIGINAL_CLASS = "WanModel"  # config.json of the original Wan-AI release folders (original key names)
SUPPORTED = ("Wan 2.1 / 2.2 T2V, I2V, FLF2V, TI2V 5B, VACE, Fun InP / Control / Camera (5B: InP, Control), HuMo, "
             "Wan 2.2 S2V, Wan 2.2 Animate, Wan Animate 2, Wan 2.2 Bernini-R (in-context latents), Wan 2.1 SCAIL / "
             "SCAIL-2, Wan 2.2 Dancer")
ORIGINAL_ANCHORS = ("patch_embedding.weight", "text_embedding.0.weight", "time_embedding.0.weight",
                    "time_projection.1.weight", "blocks.0.self_attn.q.weight", "head.head.weight", "head.modulation")
DIFFUSERS_ANCHORS = ("patch_embedding.weight", "condition_embedder.time_proj.weight",
                     "condition_embedder.text_embedder.linear_1.weight", "blocks.0.attn1.to_q.weight",
                     "scale_shift_table", "proj_out.weight")
_BLOCK_ANCHOR = "blocks.0.self_attn.q.weight"
# diffusers keys some released diffusers checkpoints carry but WanTransformer3DModel does not use
DIFFUSERS_IGNORED_SUFFIX = ".norm_added_q.weight"


def diffusers_classes() -> tuple[str, ...]:
    return (DIFFUSERS_CLASS, *(v.model_class for v in REGISTRY if v.model_class))


def original_classes() -> tuple[str, ...]:
    return (ORIGINAL_CLASS, *(v.original_class for v in REGISTRY if v.original_class))


def detect(header: Header) -> Optional[Detection]:
    """Wan 2.1 / 2.2 from the header alone; None when the file is another family."""
    folder_config = header_config(header)
    if folder_config is not None and folder_config.get("_class_name") not in (None, *diffusers_classes(),
                                                                                *original_classes()):
        name = folder_config["_class_name"]
        if name.startswith("Wan"):
            raise ValueError(f"{header.path!r} is a {name}: only {', '.join(diffusers_classes())} and "
                             f"{', '.join(original_classes()[1:])} are supported")
        return None
    prefix, own_layout = _original_prefix(header)
    if prefix is not None:
        keys = strip_prefix(header.tensors, prefix)
        _reject_unknown(header, keys, wan_key_plan(keys))
        keys = {original_key(key): value for key, value in keys.items()}
        config = architecture(keys, "original", _stated_head_dim(header, folder_config))
        _refuse_causal(header)
        stated = _stated_model_type(header)
        for variant in REGISTRY:
            if variant.marked is not None and (own_layout is variant or stated == variant.model_type):
                config.update(variant.marked(config, header.path))
        return layout_detection(header, FAMILY, ("original", prefix, config), variant_of)
    prefix = find_prefix(header.tensors, DIFFUSERS_ANCHORS)
    if prefix is None:
        return None
    keys = strip_prefix(header.tensors, prefix)
    config = architecture(keys, "diffusers", _stated_head_dim(header, folder_config))
    return layout_detection(header, FAMILY, ("diffusers", prefix, config), variant_of)


def _original_prefix(header: Header):
    """(prefix of the original / ComfyUI key layout or None, the variant whose own key layout it is or None)."""
    prefix = find_prefix(header.tensors, ORIGINAL_ANCHORS)
    if prefix is not None:
        return prefix, None
    for variant in REGISTRY:
        for block in variant.layouts:
            anchors = tuple(block if anchor == _BLOCK_ANCHOR else anchor for anchor in ORIGINAL_ANCHORS)
            prefix = find_prefix(header.tensors, anchors)
            if prefix is not None:
                return prefix, variant
    return None, None


def variant_of(config: dict) -> str:
    """The first registered variant's name that claims the config (vace, s2v, humo, animate, animate2, camera /
    camera_2.2, fun_control), else ti2v (Wan 2.2 5B, 48 latent channels), flf2v / i2v (CLIP image input),
    i2v_concat (image latent in extra input channels without CLIP: Wan 2.2 A14B I2V experts, Fun models) or t2v
    (also the Wan 2.2 A14B T2V experts)."""
    for variant in REGISTRY:
        name = variant.variant(config) if variant.variant else None
        if name:
            return name
    if config["out_channels"] == 48:
        return "ti2v"
    if config.get("image_dim"):
        return "flf2v" if config.get("pos_embed_seq_len") else "i2v"
    return "i2v_concat" if config["in_channels"] != config["out_channels"] else "t2v"


def _stated_head_dim(header: Header, folder_config: Optional[dict]) -> Optional[int]:
    """The head size where the files state it: our metadata key, or an original release folder's num_heads."""
    stated = header.metadata.get(HEAD_DIM_METADATA_KEY)
    if stated:
        return int(stated)
    if folder_config and folder_config.get("_class_name") in original_classes() and folder_config.get("num_heads"):
        return int(folder_config["dim"]) // int(folder_config["num_heads"])
    if folder_config and folder_config.get("attention_head_dim"):
        return int(folder_config["attention_head_dim"])
    return None


def _stated_model_type(header: Header) -> Optional[str]:
    """The model_type ComfyUI's model_detection reads from the file's metadata (config.transformer), if any."""
    return _stated_transformer(header).get("model_type")


def _stated_transformer(header: Header) -> dict:
    """The transformer config ComfyUI's model_detection merges from the file's metadata (config.transformer)."""
    try:
        stated = json.loads(header.metadata.get("config", "{}")).get("transformer", {})
    except (ValueError, AttributeError):  # metadata of other tools: not ComfyUI's
        return {}
    return stated if isinstance(stated, dict) else {}


def _refuse_causal(header: Header) -> None:
    """Causal Forcing / Self-Forcing files (the templates' causal_forcing-framewise) are Wan 2.1 T2V weights whose
    metadata says causal_ar: ComfyUI then builds its CausalWanModel, which SamplerARVideo runs frame block by frame
    block against a KV cache kept across calls. The pool serves whole-clip bidirectional calls only."""
    if _stated_transformer(header).get("causal_ar"):
        raise ValueError(f"{header.path!r} is a Wan 2.1 Causal Forcing model (its metadata says causal_ar): "
                         f"autoregressive frame-block sampling with a KV cache kept between calls (ComfyUI's "
                         f"CausalWanModel and SamplerARVideo) is not supported")


def _reject_unknown(header: Header, keys: dict, plan: dict) -> None:
    unknown = [key for key in keys if key not in plan]
    if unknown:
        modules = sorted({".".join("*" if part.isdigit() else part for part in key.split(".")[:-1]) or key
                          for key in unknown})
        shown = ", ".join(modules[:8]) + (f" and {len(modules) - 8} more" if len(modules) > 8 else "")
        raise ValueError(f"{header.path!r} looks like Wan but has modules this loader does not know: {shown} "
                         f"({len(unknown)} tensors): a Wan variant with extra modules, which is not supported")


def _with_heads(config: dict, head_dim: Optional[int]) -> dict:
    """Set the head size and count (None while unknown: load() then needs the head_dim option)."""
    inner = config.pop("inner_dim")
    head_dim = head_dim or DEFAULT_HEAD_DIM
    if inner % head_dim:
        config.update(attention_head_dim=None, num_attention_heads=None, inner_dim_unsplit=inner)
    else:
        config.update(attention_head_dim=head_dim, num_attention_heads=inner // head_dim)
    return config


# Where a header shows each architecture fact: (original key, diffusers key), prefix stripped
ARCHITECTURE_KEYS = {
    "out": ("head.head.weight", "proj_out.weight"),
    "text": ("text_embedding.0.weight", "condition_embedder.text_embedder.linear_1.weight"),
    "time": ("time_embedding.0.weight", "condition_embedder.time_embedder.linear_1.weight"),
    "ffn": ("blocks.0.ffn.0.weight", "blocks.0.ffn.net.0.proj.weight"),
    "cross_attn_norm": ("blocks.0.norm3.weight", "blocks.0.norm2.weight"),
    "image": ("img_emb.proj.1.weight", "condition_embedder.image_embedder.ff.net.0.proj.weight"),
    "image_kv": ("blocks.0.cross_attn.k_img.weight", "blocks.0.attn2.add_k_proj.weight"),
    "image_pos": ("img_emb.emb_pos", "condition_embedder.image_embedder.pos_embed"),
    "qk_norm": ("blocks.0.self_attn.norm_q.weight", "blocks.0.attn1.norm_q.weight"),
}


def architecture(keys: dict, layout: str, head_dim: Optional[int] = None) -> dict:
    """WanTransformer3DModel config from a header in the "original" or "diffusers" key layout (keys without
    prefix), with the entries of the variants with a key under their anchor."""
    names = layout_keys(ARCHITECTURE_KEYS, layout)

    def optional_width(fact: str) -> Optional[int]:  # parts only image models have
        return shape_of(keys, names[fact])[1] if names[fact] in keys else None

    inner, in_channels, *patch = shape_of(keys, "patch_embedding.weight")
    config = {
        "patch_size": tuple(patch),
        "inner_dim": inner,
        "in_channels": in_channels,
        "out_channels": shape_of(keys, names["out"])[0] // math.prod(patch),
        "text_dim": shape_of(keys, names["text"])[1],
        "freq_dim": shape_of(keys, names["time"])[1],
        "ffn_dim": shape_of(keys, names["ffn"])[0],
        "num_layers": count_blocks(keys, "blocks"),
        "cross_attn_norm": names["cross_attn_norm"] in keys,
        "qk_norm": "rms_norm_across_heads",
        "eps": 1e-6,
        "image_dim": optional_width("image"),
        "added_kv_proj_dim": optional_width("image_kv"),
        "rope_max_seq_len": 1024,
        "pos_embed_seq_len": optional_width("image_pos"),
    }
    for variant in REGISTRY:
        if variant.architecture is not None and any(key.startswith(variant.anchor) for key in keys):
            config.update(variant.architecture(keys, layout, config))
    if names["qk_norm"] not in keys:
        raise ValueError(f"this Wan checkpoint has no {names['qk_norm']!r}: Wan models without q/k norms are not "
                         f"supported")
    return _with_heads(config, head_dim)


def folder_overrides(folder_config: Optional[dict]) -> dict:
    """Settings of a diffusers config.json that a header cannot show (eps, rope length, VACE hint placement), kept
    when present."""
    if not folder_config or folder_config.get("_class_name") not in diffusers_classes():
        return {}
    return {key: folder_config[key] for key in ("eps", "rope_max_seq_len", "vace_layers") if key in folder_config}
