"""Krea 2 detection from a header alone, as ComfyUI's model_detection tells it (`txtfusion.projector.weight`): heads of
128 (query and key / value heads from the projections), ComfyUI's fixed text-fusion heads (20) and rotary split of
the head ((32, 48, 48) for 128, theta 1000); the release's (ComfyUI's) key names or diffusers'
(Krea2Transformer2DModel)."""
from __future__ import annotations

from typing import Optional

from ...checkpoints.header import Header
from ...checkpoints.loading import count_blocks, folder_entries, layout_keys, shape_of, two_layouts
from ...contract import Detection

NAME = "krea2"
DESCRIPTION = "Krea 2 (Raw, Turbo)"
CLASS_NAME = "Krea2Transformer2DModel"
HEAD_DIM = 128     # ComfyUI's detection: heads = wq rows / 128
TEXT_HEADS = 20    # ComfyUI's SingleStreamDiT default (txtheads = txtkvheads = 20, not read from the file)
PATCH = 2
KEYS = {"embed": ("first.weight", "img_in.weight"), "fusion": ("txtfusion.projector.weight",
                                                               "text_fusion.projector.weight"),
        "q": ("blocks.0.attn.wq.weight", "transformer_blocks.0.attn.to_q.weight"),
        "k": ("blocks.0.attn.wk.weight", "transformer_blocks.0.attn.to_k.weight"),
        "mlp": ("blocks.0.mlp.gate.weight", "transformer_blocks.0.ff.gate.weight"),
        "text_norm": ("txtfusion.layerwise_blocks.0.prenorm.scale", "text_fusion.layerwise_blocks.0.norm1.weight"),
        "text_mlp": ("txtfusion.layerwise_blocks.0.mlp.gate.weight", "text_fusion.layerwise_blocks.0.ff.gate.weight"),
        "time": ("tmlp.0.weight", "time_embed.linear_1.weight"), "blocks": ("blocks", "transformer_blocks"),
        "layerwise": ("txtfusion.layerwise_blocks", "text_fusion.layerwise_blocks"),
        "refiner": ("txtfusion.refiner_blocks", "text_fusion.refiner_blocks")}
ANCHORS = tuple(tuple(KEYS[fact][index] for fact in ("fusion", "embed", "q")) for index in (0, 1))
CONFIG_KEYS = ("in_channels", "num_layers", "attention_head_dim", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "timestep_embed_dim", "text_hidden_dim", "num_text_layers",
               "text_num_attention_heads", "text_num_key_value_heads", "text_intermediate_size",
               "num_layerwise_text_blocks", "num_refiner_text_blocks", "axes_dims_rope", "rope_theta")


def detect(header: Header) -> Optional[Detection]:
    folder = folder_entries(header, CLASS_NAME, CONFIG_KEYS, tuples=("axes_dims_rope",))
    found = two_layouts(header, folder, ANCHORS, architecture)
    if found is None:
        return None
    layout, prefix, config = found
    return Detection(family=NAME, variant="", layout=layout, prefix=prefix, config=config, files=header.source.files)


def architecture(keys: dict, layout: str) -> dict:
    """Krea2Transformer2DModel config from shapes (keys without prefix) and ComfyUI's constants."""
    name = layout_keys(KEYS, layout)
    width, in_channels = shape_of(keys, name["embed"])
    text_dim = shape_of(keys, name["text_norm"])[0]
    if width % HEAD_DIM or text_dim % TEXT_HEADS:
        raise ValueError(f"Krea 2 width {width} / text width {text_dim}: ComfyUI's Krea 2 has heads of {HEAD_DIM} "
                         f"and {TEXT_HEADS} text-fusion heads, which these widths are not whole multiples of")
    rotary = 6 * (HEAD_DIM // 16)
    return {"in_channels": in_channels, "num_layers": count_blocks(keys, name["blocks"]),
            "attention_head_dim": HEAD_DIM, "num_attention_heads": width // HEAD_DIM,
            "num_key_value_heads": shape_of(keys, name["k"])[0] // HEAD_DIM,
            "intermediate_size": shape_of(keys, name["mlp"])[0],
            "timestep_embed_dim": shape_of(keys, name["time"])[1], "text_hidden_dim": text_dim,
            "num_text_layers": shape_of(keys, name["fusion"])[1], "text_num_attention_heads": TEXT_HEADS,
            "text_num_key_value_heads": TEXT_HEADS, "text_intermediate_size": shape_of(keys, name["text_mlp"])[0],
            "num_layerwise_text_blocks": count_blocks(keys, name["layerwise"]),
            "num_refiner_text_blocks": count_blocks(keys, name["refiner"]),
            "axes_dims_rope": (HEAD_DIM - 2 * rotary, rotary, rotary), "rope_theta": 1000.0}
