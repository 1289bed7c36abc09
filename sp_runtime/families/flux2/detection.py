"""Flux.2 detection from a header alone (no weights read, no diffusers): key layout, prefix, variant (dev, klein) and
the Flux2Transformer2DModel config."""
from __future__ import annotations

from typing import Optional

from ...checkpoints.header import Header
from ...checkpoints.loading import folder_entries, layout_keys, shape_of, two_layouts
from ...contract import Detection
from ..flux.detection import shared_architecture
from ..family import layout_detection

NAME = "flux2"
PATCH = 1                  # ComfyUI's Flux.2 takes its 128-channel latents unpatched
ROPE_THETA = 2000
ORIGINAL_ANCHORS = ("double_stream_modulation_img.lin.weight", "img_in.weight", "txt_in.weight",
                    "time_in.in_layer.weight", "double_blocks.0.img_attn.norm.key_norm.scale",
                    "final_layer.linear.weight")
DIFFUSERS_ANCHORS = ("double_stream_modulation_img.linear.weight", "x_embedder.weight", "context_embedder.weight",
                     "transformer_blocks.0.attn.norm_k.weight", "proj_out.weight")
CLASS_NAME = "Flux2Transformer2DModel"
CONFIG_KEYS = ("patch_size", "in_channels", "out_channels", "num_layers", "num_single_layers", "attention_head_dim",
               "num_attention_heads", "joint_attention_dim", "mlp_ratio", "axes_dims_rope", "rope_theta",
               "guidance_embeds")
# Flux2Transformer2DModel arguments a diffusers folder's config.json may set away from the released value (the
# original layout's files fix them at diffusers' defaults)
FOLDER_ONLY_KEYS = ("timestep_guidance_channels", "eps")
# Where a header shows each architecture fact: (original key, diffusers key), prefix stripped
ARCHITECTURE_KEYS = {
    "embed": ("img_in.weight", "x_embedder.weight"),
    "head_norm": ("double_blocks.0.img_attn.norm.key_norm.scale", "transformer_blocks.0.attn.norm_k.weight"),
    "mlp": ("double_blocks.0.img_mlp.0.weight", "transformer_blocks.0.ff.linear_in.weight"),
    "out": ("final_layer.linear.weight", "proj_out.weight"),
    "double_blocks": ("double_blocks", "transformer_blocks"),
    "single_blocks": ("single_blocks", "single_transformer_blocks"),
    "text": ("txt_in.weight", "context_embedder.weight"),
    "guidance": ("guidance_in.in_layer.weight", "time_guidance_embed.guidance_embedder.linear_1.weight"),
}


def detect(header: Header) -> Optional[Detection]:
    """Flux.2 from its header alone (no weights read); None when the file is another family."""
    folder = folder_entries(header, CLASS_NAME, CONFIG_KEYS + FOLDER_ONLY_KEYS, {"axes_dims_rope": (32, 32, 32, 32)},
                            ("axes_dims_rope",))
    if folder:
        folder["out_channels"] = folder.get("out_channels") or folder["in_channels"]
    found = two_layouts(header, folder, (ORIGINAL_ANCHORS, DIFFUSERS_ANCHORS), architecture)
    return layout_detection(header, NAME, found,
                            lambda config: "dev" if config.get("guidance_embeds", True) else "klein")


def architecture(keys: dict, layout: str) -> dict:
    """Flux2Transformer2DModel config from a header in the "original" or "diffusers" key layout."""
    names = layout_keys(ARCHITECTURE_KEYS, layout)
    config = shared_architecture(keys, names, "Flux.2")
    hidden, head_dim = config["num_attention_heads"] * config["attention_head_dim"], config["attention_head_dim"]
    if head_dim % 8:
        raise ValueError(f"Flux.2 head size {head_dim} does not fit a 4-axis rotary embedding")
    return {**config, "mlp_ratio": shape_of(keys, names["mlp"])[0] / (2 * hidden),  # SwiGLU: gate and value rows
            "axes_dims_rope": (head_dim // 4,) * 4,  # (32, 32, 32, 32) at the real head size 128
            "rope_theta": ROPE_THETA, "guidance_embeds": names["guidance"] in keys}
