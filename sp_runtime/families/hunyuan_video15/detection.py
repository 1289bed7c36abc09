"""HunyuanVideo 1.5 detection from a header alone (no weights read, no diffusers): key layout (Tencent / ComfyUI or
diffusers), prefix, variant ("sr": the meanflow super-resolution model) and the HunyuanVideo15Transformer3DModel
config."""
from __future__ import annotations

from typing import Optional

from ...checkpoints.header import Header
from ...checkpoints.loading import count_blocks, folder_entries, layout_keys, shape_of, two_layouts
from ...contract import Detection
from ..hunyuan_video.detection import shared_architecture
from ..hunyuan_video.keys import REFINER_STEM, SHARED_ARCHITECTURE_KEYS, comfy_names
from ..family import layout_detection

NAME = "hunyuan_video15"
CONFIG_KEYS = ("in_channels", "out_channels", "num_attention_heads", "attention_head_dim", "num_layers",
               "num_refiner_layers", "mlp_ratio", "patch_size", "patch_size_t", "text_embed_dim", "text_embed_2_dim",
               "image_embed_dim", "rope_axes_dim", "use_meanflow")
ARCHITECTURE_KEYS = {
    **SHARED_ARCHITECTURE_KEYS,
    "byt5": ("byt5_in.fc1.weight", "context_embedder_2.linear_1.weight"),
    "image": ("vision_in.proj.0.weight", "image_embedder.norm_in.weight"),
    "guidance": ("guidance_in.in_layer.weight", "time_embed.guidance_embedder.linear_1.weight"),
    "meanflow": ("time_r_in.in_layer.weight", "time_embed.timestep_embedder_r.linear_1.weight"),
}
ORIGINAL_ANCHORS = ("cond_type_embedding.weight", f"{REFINER_STEM}.0.norm1.weight", "img_in.proj.weight",
                    "final_layer.linear.weight")
DIFFUSERS_ANCHORS = ("cond_type_embed.weight", "x_embedder.proj.weight", "context_embedder_2.linear_1.weight",
                     "proj_out.weight")
SR = "sr"  # the variant of meanflow (super-resolution) files
# Capybara (xgen-universe; ComfyUI's templates load capybara_v0.1 into its HunyuanVideo15 class) is HunyuanVideo 1.5
# plus three embedding tables its own forward reads only in its editing task modes (siglip_type_embedding for
# multi-frame SigLIP edits; task_bias and cond_special_token_embedding never). ComfyUI's class has none of them, so
# ComfyUI's call is HunyuanVideo 1.5's: they are left unread, as ComfyUI leaves them.
CAPYBARA_EXTRAS = ("cond_special_token_embedding.weight", "siglip_type_embedding.weight", "task_bias.weight")


def detect(header: Header) -> Optional[Detection]:
    """HunyuanVideo 1.5 from its header alone; None for other files."""
    folder = folder_entries(header, "HunyuanVideo15Transformer3DModel", CONFIG_KEYS, tuples=("rope_axes_dim",))
    found = two_layouts(header, folder, (ORIGINAL_ANCHORS, DIFFUSERS_ANCHORS),
                        lambda keys, layout: architecture(keys, layout, header.path))
    return layout_detection(header, NAME, found, lambda config: SR if config.get("use_meanflow") else "")


def architecture(keys: dict, layout: str, path: str = "") -> dict:
    """HunyuanVideo15Transformer3DModel config from a header (keys without prefix: Tencent, ComfyUI or diffusers
    names)."""
    names, keys = layout_keys(ARCHITECTURE_KEYS, layout), comfy_names(keys) if layout == "original" else keys
    if names["guidance"] in keys or count_blocks(keys, names["single_blocks"]):
        raise ValueError(f"{path!r} is a HunyuanVideo 1.5 variant with a guidance embedding or single-stream blocks, "
                         f"which diffusers' HunyuanVideo 1.5 (and so ulysses-sp) does not have")
    return {**shared_architecture(keys, names, "HunyuanVideo 1.5"),
            "text_embed_2_dim": shape_of(keys, names["byt5"])[1],
            "image_embed_dim": shape_of(keys, names["image"])[0],
            "use_meanflow": names["meanflow"] in keys}
