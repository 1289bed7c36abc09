"""LongCat-Image (and Edit) detection from a header alone, as ComfyUI's model_detection tells it: a Flux-layout file
(ComfyUI's `double_blocks` / `single_blocks`) with no pooled-text `vector_in`, no guidance embedder and a text width of
3584 (Qwen2.5-VL 7B); or diffusers' LongCatImageTransformer2DModel names / folder. The edit model has the same
weights layout (its references arrive as ref_latents)."""
from __future__ import annotations

from typing import Optional

from ...checkpoints.header import Header
from ...checkpoints.loading import folder_entries, layout_keys, shape_of, two_layouts
from ...sp.tokens import rope_axes
from ..family import layout_detection
from ..flux.detection import ARCHITECTURE_KEYS, MLP_RATIO, shared_architecture

NAME = "longcat_image"
CLASS_NAME = "LongCatImageTransformer2DModel"
TEXT_WIDTH = 3584  # ComfyUI tells LongCat-Image from other vector-free Flux files by it
ORIGINAL_ANCHORS = ("double_blocks.0.img_attn.norm.key_norm.scale", "img_in.weight", "txt_in.weight",
                    "time_in.in_layer.weight", "double_blocks.0.img_mlp.0.weight", "final_layer.linear.weight")
DIFFUSERS_ANCHORS = ("x_embedder.weight", "context_embedder.weight", "time_embed.timestep_embedder.linear_1.weight",
                     "transformer_blocks.0.attn.norm_added_k.weight", "proj_out.weight")
OTHER_FLUX = ("vector_in.in_layer.weight", "guidance_in.in_layer.weight", "txt_norm.weight", "txt_norm.scale")
CONFIG_KEYS = ("patch_size", "in_channels", "num_layers", "num_single_layers", "attention_head_dim",
               "num_attention_heads", "joint_attention_dim", "pooled_projection_dim", "axes_dims_rope")


def detect(header: Header):
    folder = folder_entries(header, CLASS_NAME, CONFIG_KEYS, {"axes_dims_rope": (16, 56, 56)}, ("axes_dims_rope",))
    found = two_layouts(header, folder, (ORIGINAL_ANCHORS, DIFFUSERS_ANCHORS), architecture)
    return layout_detection(header, NAME, found)


def architecture(keys: dict, layout: str) -> Optional[dict]:
    """LongCatImageTransformer2DModel config from shapes; None for another Flux-layout model (pooled text, guidance,
    Ovis' text norm, another text width)."""
    names = {**layout_keys(ARCHITECTURE_KEYS, layout), "mlp": ("double_blocks.0.img_mlp.0.weight",
                                                                "transformer_blocks.0.ff.net.0.proj.weight")[
        ("original", "diffusers").index(layout)]}
    if layout == "original" and any(key in keys for key in OTHER_FLUX):
        return None
    config = shared_architecture(keys, names, "LongCat-Image")
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    if layout == "original" and config["joint_attention_dim"] != TEXT_WIDTH:
        return None
    if shape_of(keys, names["mlp"])[0] != MLP_RATIO * hidden or config["out_channels"] != config["in_channels"]:
        raise ValueError(f"LongCat-Image file with MLP width {shape_of(keys, names['mlp'])[0]} (width {hidden}) and "
                         f"{config['out_channels']} output features: unsupported variant")
    config.pop("out_channels")
    return {**config, "pooled_projection_dim": config["joint_attention_dim"],
            "axes_dims_rope": rope_axes(config["attention_head_dim"])}
