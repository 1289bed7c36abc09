"""MiniMax H3 detection from a header alone, as ComfyUI reads its files (`video_patch_proj` + `audio_patch_proj`,
with or without `model.diffusion_model.`): widths from the patch / condition projections, heads from the fused qkv
and the q norm, depth from `blocks` and `token_refiner.blocks`; the pruned ("curve") form by its `adaln_t_table`
(it replaces the time embedder: every published template file is pruned), FastH3's PDD head bank by an output head
with several heads' rows (`final_layer.video_out`)."""
from __future__ import annotations

from typing import Optional

from ...contract import Detection
from ...checkpoints.loading import count_blocks, find_prefix, shape_of, strip_prefix
from ...checkpoints.header import Header

NAME = "minimax_h3"
DESCRIPTION = "MiniMax H3 (audio + video: t2va, fl2va; pruned and full files)"
PATCH = (1, 2, 2)  # ComfyUI's MiniMaxH3Model default; the header does not show it
ANCHORS = ("video_patch_proj.weight", "audio_patch_proj.weight", "condition_proj.weight",
           "blocks.0.adaln_proj.linear.weight", "final_layer.video_out.weight")
CONFIG_KEYS = ("num_attention_heads", "attention_head_dim", "hidden_size", "num_layers", "num_refiner_layers",
               "ffn_dim", "in_channels", "audio_in_channels", "text_dim", "freq_dim", "time_embed_hidden_dim",
               "time_embed_dim", "rope_freq_dim", "adaln_curve_grid", "pdd_heads")
MODEL_KEYS = CONFIG_KEYS[:-2]  # what diffusers' MiniMaxH3Transformer3DModel takes


def detect(header: Header) -> Optional[Detection]:
    prefix = find_prefix(header.tensors, ANCHORS)
    if prefix is None:
        return None
    keys = strip_prefix(header.tensors, prefix)
    config = architecture(keys)
    variant = "fast" if config["pdd_heads"] > 1 else "pruned" if config["adaln_curve_grid"] else "full"
    return Detection(family=NAME, variant=variant, layout="original", prefix=prefix, config=config,
                     files=header.source.files)


def architecture(keys: dict) -> dict:
    """MiniMaxH3Transformer3DModel config (plus the curve grid and the number of PDD heads) from header shapes."""
    hidden, video_patch = shape_of(keys, "video_patch_proj.weight")
    head_dim = shape_of(keys, "blocks.0.attn.q_norm.weight")[0]
    inner = shape_of(keys, "blocks.0.attn.qkv_proj.weight")[0] // 3
    patch_volume = PATCH[0] * PATCH[1] * PATCH[2]
    curve = shape_of(keys, "adaln_t_table") if "adaln_t_table" in keys else None
    timing = ({"freq_dim": 256, "time_embed_hidden_dim": curve[1], "time_embed_dim": curve[1]} if curve else
              {"freq_dim": shape_of(keys, "time_embedder.proj_in.weight")[1],
               "time_embed_hidden_dim": shape_of(keys, "time_embedder.proj_in.weight")[0],
               "time_embed_dim": shape_of(keys, "time_embedder.proj_out.weight")[0]})
    rope = shape_of(keys, "rope.inv_freq")[0] if "rope.inv_freq" in keys else 16
    if inner % head_dim or 6 * rope > head_dim:
        raise ValueError(f"MiniMax H3 attention of {inner} channels does not fit heads of {head_dim} with "
                         f"{6 * rope} rotary channels")
    return {"num_attention_heads": inner // head_dim, "attention_head_dim": head_dim, "hidden_size": hidden,
            "num_layers": count_blocks(keys, "blocks"), "num_refiner_layers": count_blocks(keys, "token_refiner.blocks"),
            "ffn_dim": shape_of(keys, "blocks.0.mlp.fc2.weight")[1], "in_channels": video_patch // patch_volume,
            "audio_in_channels": shape_of(keys, "audio_patch_proj.weight")[1],
            "text_dim": shape_of(keys, "condition_proj.weight")[1], **timing, "rope_freq_dim": rope,
            "adaln_curve_grid": curve[0] if curve else 0,
            "pdd_heads": shape_of(keys, "final_layer.video_out.weight")[0] // video_patch}
