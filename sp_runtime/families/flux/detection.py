"""Flux.1 detection from a header alone (no weights read, no diffusers): the key layout (original BFL / ComfyUI or
diffusers), the prefix, the variant and the FluxTransformer2DModel config."""
from __future__ import annotations

from typing import Optional

from ...checkpoints.header import Header
from ...checkpoints.loading import count_blocks, folder_entries, layout_keys, shape_of, two_layouts
from ...contract import Detection
from ...sp.tokens import rope_axes
from ..family import layout_detection

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
    folder = folder_entries(header, "FluxTransformer2DModel", CONFIG_KEYS, {"axes_dims_rope": (16, 56, 56)},
                            ("axes_dims_rope",))
    if folder:  # diffusers' out_channels None: as many as in
        folder["out_channels"] = folder.get("out_channels") or folder["in_channels"]
    found = two_layouts(header, folder, (ORIGINAL_ANCHORS, DIFFUSERS_ANCHORS), architecture)
    return layout_detection(header, NAME, found, variant_of)


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
    config = shared_architecture(keys, names, "Flux")
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    if shape_of(keys, names["mlp"])[0] != MLP_RATIO * hidden:
        raise ValueError(f"Flux MLP width {shape_of(keys, names['mlp'])[0]} is not {MLP_RATIO} x {hidden}: "
                         f"unsupported variant")
    if layout == "original" and count_blocks(keys, "single_blocks"):  # fused qkv + MLP rows
        rows = shape_of(keys, "single_blocks.0.linear1.weight")[0]
        if rows != (3 + MLP_RATIO) * hidden:
            raise ValueError(f"Flux single blocks have {rows} fused rows; {(3 + MLP_RATIO) * hidden} expected for "
                             f"width {hidden}: unsupported variant")
    return {**config, "pooled_projection_dim": shape_of(keys, names["pooled"])[1],
            "guidance_embeds": names["guidance"] in keys, "axes_dims_rope": rope_axes(config["attention_head_dim"])}


def shared_architecture(keys: dict, names: dict, what: str) -> dict:
    """The config entries Flux.1, Flux.2 and Chroma read alike from a header (names: the facts embed, head_norm,
    out, double_blocks, single_blocks, text in the file's layout)."""
    hidden, in_features = shape_of(keys, names["embed"])
    head_dim = shape_of(keys, names["head_norm"])[0]
    if hidden % head_dim:
        raise ValueError(f"{what} width {hidden} is not a multiple of its head size {head_dim}")
    return {
        "patch_size": 1,
        "in_channels": in_features,
        "out_channels": shape_of(keys, names["out"])[0],
        "num_layers": count_blocks(keys, names["double_blocks"]),
        "num_single_layers": count_blocks(keys, names["single_blocks"]),
        "attention_head_dim": head_dim,
        "num_attention_heads": hidden // head_dim,
        "joint_attention_dim": shape_of(keys, names["text"])[1],
    }
