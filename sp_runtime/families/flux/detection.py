"""Flux.1 detection from a header alone (no weights read, no diffusers): the key layout (original BFL / ComfyUI or
diffusers), the prefix, the variant and the FluxTransformer2DModel config."""
from __future__ import annotations

from typing import Optional

from ...checkpoints.header import Header, header_config
from ...checkpoints.loading import count_blocks, find_prefix, layout_keys, shape_of, strip_prefix
from ...contract import Detection
from ...sp.tokens import rope_axes

NAME = "flux"
PATCH = 2
MLP_RATIO = 4  # diffusers' Flux blocks hardcode it
ORIGINAL_ANCHORS = ("double_blocks.0.img_attn.norm.key_norm.scale", "img_in.weight", "txt_in.weight",
                    "time_in.in_layer.weight", "vector_in.in_layer.weight", "final_layer.linear.weight")
DIFFUSERS_ANCHORS = ("x_embedder.weight", "context_embedder.weight", "transformer_blocks.0.attn.norm_added_k.weight",
                     "time_text_embed.text_embedder.linear_1.weight", "proj_out.weight")
REF_METHODS = ("index", "uxo")  # others ("offset", ComfyUI's default) place references side by side
CONFIG_KEYS = ("patch_size", "in_channels", "out_channels", "num_layers", "num_single_layers", "attention_head_dim",
               "num_attention_heads", "joint_attention_dim", "pooled_projection_dim", "guidance_embeds",
               "axes_dims_rope")


def detect(header: Header) -> Optional[Detection]:
    """Flux.1 from its header alone (no weights read); None when the file is another family."""
    folder_config = header_config(header)
    if folder_config is not None:
        if folder_config.get("_class_name") != "FluxTransformer2DModel":
            return None
        config = {key: folder_config[key] for key in CONFIG_KEYS if key in folder_config}
        config["axes_dims_rope"] = tuple(config.get("axes_dims_rope", (16, 56, 56)))
        config["out_channels"] = config.get("out_channels") or config["in_channels"]  # diffusers' None = same
        return _detection(header, "diffusers", "", config)
    for layout, anchors in (("original", ORIGINAL_ANCHORS), ("diffusers", DIFFUSERS_ANCHORS)):
        prefix = find_prefix(header.tensors, anchors)
        if prefix is not None:
            return _detection(header, layout, prefix, architecture(strip_prefix(header.tensors, prefix), layout))
    return None


def _detection(header: Header, layout: str, prefix: str, config: dict) -> Detection:
    return Detection(family=NAME, variant=variant_of(config), layout=layout, prefix=prefix, config=config,
                     files=header.source.files)


def variant_of(config: dict) -> str:
    """dev (also Kontext: same weights layout), schnell, fill or control (Depth / Canny), from the config."""
    if config["in_channels"] == 384:
        return "fill"
    if config["in_channels"] == 128:
        return "control"
    return "dev" if config.get("guidance_embeds") else "schnell"


# Where a header shows each architecture fact: (original key, diffusers key), prefix stripped
ARCHITECTURE_KEYS = {
    "embed": ("img_in.weight", "x_embedder.weight"),
    "head_norm": ("double_blocks.0.img_attn.norm.key_norm.scale", "transformer_blocks.0.attn.norm_q.weight"),
    "mlp": ("double_blocks.0.img_mlp.0.weight", "transformer_blocks.0.ff.net.0.proj.weight"),
    "out": ("final_layer.linear.weight", "proj_out.weight"),
    "double_blocks": ("double_blocks", "transformer_blocks"),
    "single_blocks": ("single_blocks", "single_transformer_blocks"),
    "text": ("txt_in.weight", "context_embedder.weight"),
    "pooled": ("vector_in.in_layer.weight", "time_text_embed.text_embedder.linear_1.weight"),
    "guidance": ("guidance_in.in_layer.weight", "time_text_embed.guidance_embedder.linear_1.weight"),
}


def architecture(keys: dict, layout: str) -> dict:
    """FluxTransformer2DModel config from a header in the "original" or "diffusers" key layout (keys without
    prefix)."""
    names = layout_keys(ARCHITECTURE_KEYS, layout)
    hidden, in_features = shape_of(keys, names["embed"])
    head_dim = shape_of(keys, names["head_norm"])[0]
    _check_width(hidden, head_dim, shape_of(keys, names["mlp"])[0])
    if layout == "original" and count_blocks(keys, "single_blocks"):  # fused qkv + MLP rows
        rows = shape_of(keys, "single_blocks.0.linear1.weight")[0]
        if rows != (3 + MLP_RATIO) * hidden:
            raise ValueError(f"Flux single blocks have {rows} fused rows; {(3 + MLP_RATIO) * hidden} expected for "
                             f"width {hidden}: unsupported variant")
    return {
        "patch_size": 1,
        "in_channels": in_features,
        "out_channels": shape_of(keys, names["out"])[0],
        "num_layers": count_blocks(keys, names["double_blocks"]),
        "num_single_layers": count_blocks(keys, names["single_blocks"]),
        "attention_head_dim": head_dim,
        "num_attention_heads": hidden // head_dim,
        "joint_attention_dim": shape_of(keys, names["text"])[1],
        "pooled_projection_dim": shape_of(keys, names["pooled"])[1],
        "guidance_embeds": names["guidance"] in keys,
        "axes_dims_rope": rope_axes(head_dim),
    }


def _check_width(hidden: int, head_dim: int, mlp_rows: int) -> None:
    if hidden % head_dim:
        raise ValueError(f"Flux width {hidden} is not a multiple of its head size {head_dim}")
    if mlp_rows != MLP_RATIO * hidden:
        raise ValueError(f"Flux MLP width {mlp_rows} is not {MLP_RATIO} x {hidden}: unsupported variant")
