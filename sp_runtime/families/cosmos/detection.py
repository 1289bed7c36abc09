"""Cosmos-Predict2 detection from a header alone: ComfyUI's MiniTrainDIT keys (`blocks.N.mlp.layer1`, as ComfyUI's
model_detection) or diffusers' CosmosTransformer3DModel, and the config ComfyUI's detection fixes for each size;
Anima files (an LLM adapter before the DiT) are the anima family's; learnable extra positions are refused by name."""
from __future__ import annotations

from typing import Optional

from ...checkpoints.header import Header
from ...checkpoints.loading import count_blocks, find_layout, folder_entries, shape_of
from ...contract import Detection

NAME = "cosmos"
CLASS_NAME = "CosmosTransformer3DModel"
PATCH = (1, 2, 2)
MAX_SIZE = (128, 240, 240)
ORIGINAL_ANCHORS = ("blocks.0.mlp.layer1.weight", "x_embedder.proj.1.weight", "t_embedding_norm.weight")
DIFFUSERS_ANCHORS = ("transformer_blocks.0.ff.net.0.proj.weight", "patch_embed.proj.weight", "time_embed.norm.weight")
UNUSED = ("pos_embedder.seq", "pos_embedder.dim_spatial_range", "pos_embedder.dim_temporal_range")
CONFIG_KEYS = ("in_channels", "out_channels", "num_attention_heads", "attention_head_dim", "num_layers",
               "mlp_ratio", "text_embed_dim", "adaln_lora_dim", "rope_scale")
FOLDER_KEYS = CONFIG_KEYS + ("max_size", "patch_size", "concat_padding_mask", "extra_pos_embed_type")
ANIMA_STEM = "llm_adapter."  # Anima's LLM adapter: its files are the anima family's (families/anima)
REFUSED = {"extra_pos_embedder.": "a Cosmos model with learnable extra positions (extra_pos_embedder)"}


def detect(header: Header) -> Optional[Detection]:
    """Cosmos-Predict2 from its header alone (no weights read); None when the file is another family."""
    folder = folder_entries(header, CLASS_NAME, FOLDER_KEYS, tuples=("rope_scale", "max_size", "patch_size"))
    if folder == {}:
        return None
    found = find_layout(header, ORIGINAL_ANCHORS, DIFFUSERS_ANCHORS)
    if found is None:
        return None
    layout, prefix, keys = found
    if any(key.startswith(ANIMA_STEM) for key in keys):
        return None
    learnable = (folder or {}).get("extra_pos_embed_type")
    for stem, what in REFUSED.items():
        if any(key.startswith(stem) for key in keys) or (learnable and "extra" in stem):
            raise ValueError(f"{header.path!r} is {what}: not supported (Cosmos-Predict2 text-to-image and "
                             f"video-to-world files load)")
    config = folder or architecture(keys, layout == "original")
    return Detection(family=NAME, variant="t2i" if config["in_channels"] == 16 else "v2w", layout=layout,
                     prefix=prefix, config=config, files=header.source.files)


def architecture(keys: dict, original: bool) -> dict:
    """CosmosTransformer3DModel config from header shapes (keys without prefix), with ComfyUI's rope scales."""
    name = (lambda ours, theirs: ours if original else theirs)
    dim, features = shape_of(keys, name("x_embedder.proj.1.weight", "patch_embed.proj.weight"))
    head_dim = shape_of(keys, name("blocks.0.self_attn.q_norm.weight", "transformer_blocks.0.attn1.norm_q.weight"))[0]
    spatial = head_dim // 6 * 2
    if dim % head_dim or spatial % 2 or head_dim % 2:
        raise ValueError(f"Cosmos width {dim} with head size {head_dim}: the width must be whole heads and the "
                         f"head carry three even rotary axes")
    in_channels = features // (PATCH[0] * PATCH[1] * PATCH[2]) - 1  # the padding-mask channel
    hidden = shape_of(keys, name("blocks.0.mlp.layer1.weight", "transformer_blocks.0.ff.net.0.proj.weight"))[0]
    return {
        "in_channels": in_channels, "out_channels": 16,
        "num_attention_heads": dim // head_dim, "attention_head_dim": head_dim,
        "num_layers": count_blocks(keys, name("blocks", "transformer_blocks")),
        "mlp_ratio": hidden / dim,
        "text_embed_dim": shape_of(keys, name("blocks.0.cross_attn.k_proj.weight",
                                              "transformer_blocks.0.attn2.to_k.weight"))[1],
        "adaln_lora_dim": shape_of(keys, name("blocks.0.adaln_modulation_self_attn.1.weight",
                                              "transformer_blocks.0.norm1.linear_1.weight"))[0],
        "max_size": MAX_SIZE, "patch_size": PATCH, "rope_scale": rope_scale(in_channels, dim),
        "concat_padding_mask": True, "extra_pos_embed_type": None,
    }


def rope_scale(in_channels: int, dim: int) -> tuple[float, float, float]:
    """(frame, row, column) rotary extrapolation as ComfyUI's detection sets it per model."""
    if in_channels == 16:
        return (1.0, 4.0, 4.0)
    return (1.0, 3.0, 3.0) if dim == 2048 else (0.8333333333333334, 2.0, 2.0)
