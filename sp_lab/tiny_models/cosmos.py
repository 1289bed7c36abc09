"""Tiny random-weight Cosmos-Predict2 models (diffusers' CosmosTransformer3DModel: 6 heads of size 12, 2 blocks,
adaLN-LoRA of width 8, a 32-wide text) and their files in ComfyUI's key layout (MiniTrainDIT: `blocks.N.self_attn`,
`adaln_modulation_*`, `mlp.layer1`, `x_embedder.proj.1`, `t_embedder.1`, `t_embedding_norm`, `final_layer`);
written separately from the loader's key plan so that a round trip checks both."""
from __future__ import annotations

import torch

from .weights import plain_tiny

COSMOS_TINY = dict(in_channels=16, out_channels=16, num_attention_heads=6, attention_head_dim=12, num_layers=2,
                   mlp_ratio=2.0, text_embed_dim=32, adaln_lora_dim=8, max_size=(128, 240, 240), patch_size=(1, 2, 2),
                   rope_scale=(1.0, 4.0, 4.0), concat_padding_mask=True, extra_pos_embed_type=None)
_TOP = {"time_embed.t_embedder.": "t_embedder.1.", "time_embed.norm.": "t_embedding_norm.",
        "patch_embed.proj.": "x_embedder.proj.1.", "norm_out.linear_1.": "final_layer.adaln_modulation.1.",
        "norm_out.linear_2.": "final_layer.adaln_modulation.2.", "proj_out.": "final_layer.linear."}
_BLOCK = {"norm1.linear_": "adaln_modulation_self_attn.", "norm2.linear_": "adaln_modulation_cross_attn.",
          "norm3.linear_": "adaln_modulation_mlp.", "attn1.": "self_attn.", "attn2.": "cross_attn.",
          "to_q.": "q_proj.", "to_k.": "k_proj.", "to_v.": "v_proj.", "to_out.0.": "output_proj.",
          "norm_q.": "q_norm.", "norm_k.": "k_norm.", "ff.net.0.proj.": "mlp.layer1.", "ff.net.2.": "mlp.layer2."}


tiny_config, build_tiny_model = plain_tiny("cosmos", "CosmosTransformer3DModel", COSMOS_TINY)


def original_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """ComfyUI's names for every weight."""
    return {_original_name(key): value.detach() for key, value in model.state_dict().items()}


def _original_name(key: str) -> str:
    for ours, theirs in _TOP.items():
        if key.startswith(ours):
            return theirs + key[len(ours):]
    stem, index, rest = key.split(".", 2)
    for ours, theirs in _BLOCK.items():
        rest = rest.replace(ours, theirs)
    return f"blocks.{index}.{rest}"
