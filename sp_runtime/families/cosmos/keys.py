"""Cosmos-Predict2's key plan: ComfyUI's (the release's MiniTrainDIT) names -> diffusers', one key at a time (the
renames of diffusers' convert_cosmos_transformer_checkpoint_to_diffusers for Cosmos 2)."""
from __future__ import annotations

from typing import Iterable

from ...checkpoints.loading import KeyPlan, original_layout_plan
from .detection import UNUSED

RENAMES = (("t_embedder.1.", "time_embed.t_embedder."), ("t_embedding_norm.", "time_embed.norm."),
           ("blocks.", "transformer_blocks."),
           ("adaln_modulation_self_attn.1.", "norm1.linear_1."), ("adaln_modulation_self_attn.2.", "norm1.linear_2."),
           ("adaln_modulation_cross_attn.1.", "norm2.linear_1."),
           ("adaln_modulation_cross_attn.2.", "norm2.linear_2."),
           ("adaln_modulation_mlp.1.", "norm3.linear_1."), ("adaln_modulation_mlp.2.", "norm3.linear_2."),
           ("self_attn.", "attn1."), ("cross_attn.", "attn2."), ("q_proj.", "to_q."), ("k_proj.", "to_k."),
           ("v_proj.", "to_v."), ("output_proj.", "to_out.0."), ("q_norm.", "norm_q."), ("k_norm.", "norm_k."),
           ("mlp.layer1.", "ff.net.0.proj."), ("mlp.layer2.", "ff.net.2."), ("x_embedder.proj.1.", "patch_embed.proj."),
           ("final_layer.adaln_modulation.1.", "norm_out.linear_1."),
           ("final_layer.adaln_modulation.2.", "norm_out.linear_2."), ("final_layer.linear.", "proj_out."))


def original_plan(keys: Iterable[str], config=None) -> KeyPlan:
    """ComfyUI key names -> parameters (LoRAs use these names too)."""
    return {key: [(renamed(key), None)] for key in keys if key not in UNUSED}


weight_plan = original_layout_plan(original_plan)


def renamed(key: str) -> str:
    for old, new in RENAMES:
        if old != "blocks." or key.startswith(old):  # only the top-level ModuleList is renamed
            key = key.replace(old, new)
    return key
