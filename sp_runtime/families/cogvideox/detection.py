"""CogVideoX detection from a header alone (no weights read, no diffusers), as ComfyUI's model_detection reads it
("cogvideox": `blocks.0.norm1.linear.weight`; a 2-D `patch_embed.proj` is the 1.5 layout, 2 x 2 x 2 patches; ofs
from `ofs_embedding_linear_1`; `patch_embed.pos_embedding`: learned positions instead of rotary), in ComfyUI's key
layout (`blocks.N.q`, flat `time_embedding_linear_1`) or diffusers' (`transformer_blocks.N.attn1.to_q`). ComfyUI
fixes heads of 64; the header's norm_q gives the same for released files (and the tiny models' own). Served: the
1.5 layout with rotary (CogVideoX 1.5, CogVideoX-Fun V1.5, VOID's inpainting passes); CogVideoX 1.0 files (a Conv2d
patch embedding: the 2B / 5B releases, Fun V1.1) and learned positional embeddings are refused by name."""
from __future__ import annotations

from typing import Optional

from ...checkpoints.header import Header
from ...checkpoints.loading import count_blocks, folder_entries, layout_keys, shape_of, two_layouts
from ..family import layout_detection

NAME = "cogvideox"
CLASS_NAME = "CogVideoXTransformer3DModel"
DESCRIPTION = "CogVideoX 1.5 (T2V, I2V, CogVideoX-Fun inpainting: VOID)"
PATCH, PATCH_T = 2, 2  # the 1.5 layout's patch (ComfyUI's too): the Linear's inputs are channels x 8
ROPE_THETA = 10000.0
VARIANTS = {16: "t2v", 32: "i2v", 48: "inpaint"}  # by input channels (latent, + image latent, + mask and video)
CONFIG_KEYS = ("in_channels", "out_channels", "num_attention_heads", "attention_head_dim", "time_embed_dim",
               "ofs_embed_dim", "text_embed_dim", "num_layers", "patch_size", "patch_size_t",
               "use_rotary_positional_embeddings")
# fact -> (ComfyUI's key, diffusers' key)
KEYS = {"embed": ("patch_embed.proj.weight", "patch_embed.proj.weight"),
        "text": ("patch_embed.text_proj.weight", "patch_embed.text_proj.weight"),
        "time": ("time_embedding_linear_1.weight", "time_embedding.linear_1.weight"),
        "ofs": ("ofs_embedding_linear_1.weight", "ofs_embedding.linear_1.weight"),
        "norm_q": ("blocks.0.norm_q.weight", "transformer_blocks.0.attn1.norm_q.weight"),
        "ff": ("blocks.0.ff_proj.weight", "transformer_blocks.0.ff.net.0.proj.weight"),
        "blocks": ("blocks", "transformer_blocks")}
ANCHORS = (("patch_embed.text_proj.weight", "time_embedding_linear_1.weight", "blocks.0.attn_out.weight"),
           ("patch_embed.text_proj.weight", "time_embedding.linear_1.weight",
            "transformer_blocks.0.attn1.to_out.0.weight"))


def detect(header: Header) -> Optional[object]:
    """CogVideoX from its header alone; None for other files (CogView's `patch_embed.text_proj` too)."""
    folder = folder_entries(header, CLASS_NAME, CONFIG_KEYS)
    if folder:
        _refuse_folder(header, folder)
    found = two_layouts(header, folder, ANCHORS, lambda keys, layout: architecture(header, keys, layout))
    return layout_detection(header, NAME, found, lambda config: VARIANTS.get(config["in_channels"], ""))


def architecture(header: Header, keys: dict, layout: str) -> dict:
    """CogVideoXTransformer3DModel config from shapes (keys without prefix)."""
    name = layout_keys(KEYS, layout)
    embed = shape_of(keys, name["embed"])
    if len(embed) != 2:
        raise ValueError(f"{header.path!r} is a CogVideoX 1.0 model (Conv2d patch embedding: CogVideoX 2B / 5B, "
                         f"CogVideoX-Fun V1.1): not supported; CogVideoX 1.5-layout files (Linear patch embedding, "
                         f"e.g. VOID's passes) load")
    if "patch_embed.pos_embedding" in keys:
        raise ValueError(f"{header.path!r} is a CogVideoX model with learned positional embeddings "
                         f"(patch_embed.pos_embedding): not supported")
    hidden, features = embed
    head_dim = shape_of(keys, name["norm_q"])[0]
    volume = PATCH_T * PATCH * PATCH
    if hidden % head_dim or features % volume or shape_of(keys, name["ff"])[0] != 4 * hidden:
        raise ValueError(f"{header.path!r}: CogVideoX width {hidden}, patch features {features}, head size "
                         f"{head_dim}: unsupported variant")
    return {"in_channels": features // volume, "out_channels": shape_of(keys, "proj_out.weight")[0] // volume,
            "num_attention_heads": hidden // head_dim, "attention_head_dim": head_dim,
            "time_embed_dim": shape_of(keys, name["time"])[0],
            "ofs_embed_dim": shape_of(keys, name["ofs"])[1] if name["ofs"] in keys else None,
            "text_embed_dim": shape_of(keys, name["text"])[1], "num_layers": count_blocks(keys, name["blocks"]),
            "patch_size": PATCH, "patch_size_t": PATCH_T, "use_rotary_positional_embeddings": True}


def _refuse_folder(header: Header, config: dict) -> None:
    """A diffusers folder the plan does not serve (1.0 patch, sinusoidal positions), by name."""
    if not config.get("patch_size_t") or not config.get("use_rotary_positional_embeddings"):
        raise ValueError(f"{header.path!r} is a CogVideoX 1.0 / 2B model (no temporal patch or no rotary): not "
                         f"supported; CogVideoX 1.5-layout models load")
