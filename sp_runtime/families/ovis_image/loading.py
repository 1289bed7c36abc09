"""Ovis-Image's model: diffusers' OvisImageTransformer2DModel with its SwiGLU projections (up and gate in one Linear:
the double blocks' `ff.net.0.proj`, the single blocks' `proj_mlp`) rebuilt as two Linears, as ComfyUI's files keep
them (quantized files keep both quantized, LoRAs address each, tensor parallelism splits each), and the text norm's
epsilon ComfyUI's RMSNorm uses (its dtype's)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...checkpoints.loading import WeightDtypes, build_empty_model


class SwiGLUPair(torch.nn.Module):
    """diffusers' SwiGLU (up(x) * silu(gate(x))) with up and gate as two Linears, from the fused Linear's sizes."""

    def __init__(self, fused: torch.nn.Linear):
        super().__init__()
        width, bias = fused.out_features // 2, fused.bias is not None
        self.up_proj = torch.nn.Linear(fused.in_features, width, bias=bias)
        self.gate_proj = torch.nn.Linear(fused.in_features, width, bias=bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.up_proj(hidden_states) * F.silu(self.gate_proj(hidden_states))


class SwiGLUHalves(SwiGLUPair):
    """A single block's `proj_mlp` ([up, gate] features, which diffusers' block splits and gates itself)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.up_proj(hidden_states), self.gate_proj(hidden_states)], dim=-1)


def split_mlps(model) -> None:
    for block in model.transformer_blocks:
        for feed_forward in (block.ff, block.ff_context):
            feed_forward.net[0] = SwiGLUPair(feed_forward.net[0].proj)
    for block in model.single_transformer_blocks:
        block.proj_mlp = SwiGLUHalves(block.proj_mlp)
    model.context_embedder_norm.eps = None  # torch's default: the input dtype's epsilon, as ComfyUI's txt_norm


def build_model(model_class, config: dict, dtypes: WeightDtypes):
    return build_empty_model(model_class, config, dtypes, change=split_mlps)
