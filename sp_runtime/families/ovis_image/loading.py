"""Ovis-Image's model: diffusers' OvisImageTransformer2DModel with each double block's SwiGLU (`ff.net.0`, up and gate
in one Linear) rebuilt with the two projections apart, as ComfyUI's files keep them (so quantized files keep both
quantized and LoRAs address each), and the text norm's epsilon ComfyUI's RMSNorm uses (its dtype's)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...checkpoints.loading import WeightDtypes, build_empty_model


class SwiGLUPair(torch.nn.Module):
    """diffusers' SwiGLU (up(x) * silu(gate(x))) with up and gate as two Linears."""

    def __init__(self, fused: torch.nn.Linear):
        super().__init__()
        width, bias = fused.out_features // 2, fused.bias is not None
        self.up_proj = torch.nn.Linear(fused.in_features, width, bias=bias)
        self.gate_proj = torch.nn.Linear(fused.in_features, width, bias=bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.up_proj(hidden_states) * F.silu(self.gate_proj(hidden_states))


def split_mlps(model) -> None:
    for block in model.transformer_blocks:
        for feed_forward in (block.ff, block.ff_context):
            feed_forward.net[0] = SwiGLUPair(feed_forward.net[0].proj)
    model.context_embedder_norm.eps = None  # torch's default: the input dtype's epsilon, as ComfyUI's txt_norm


def build_model(model_class, config: dict, dtypes: WeightDtypes):
    return build_empty_model(model_class, config, dtypes, change=split_mlps)
