"""Lens' model: diffusers' QwenImageTransformer2DModel (patch 1) with what ComfyUI's LensTransformer2DModel has
instead: SwiGLU MLPs without biases (w2(silu(w1(x)) * w3(x)), ComfyUI's GateMLP), RMS-normed blocks with weights
(epsilon 1e-6; Qwen-Image: LayerNorm without them), q / k norms of epsilon 1e-5 and one RMSNorm (epsilon 1e-5) per
text-encoder layer before txt_in, each layer a contiguous slice of the context's features. Built through
build_empty_model's change= so fp8 layerwise casting reaches the rebuilt modules."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...checkpoints.loading import WeightDtypes, build_empty_model
from .detection import LENS_KEYS

BLOCK_EPS, ATTENTION_EPS, TEXT_EPS = 1e-6, 1e-5, 1e-5
BLOCK_NORMS = ("img_norm1", "img_norm2", "txt_norm1", "txt_norm2")
QK_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")


class GateMLP(torch.nn.Module):
    """SwiGLU without biases under ComfyUI's names: w2(silu(w1(x)) * w3(x))."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.w1 = torch.nn.Linear(width, hidden, bias=False)
        self.w2 = torch.nn.Linear(hidden, width, bias=False)
        self.w3 = torch.nn.Linear(width, hidden, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(hidden_states)) * self.w3(hidden_states))


class TextLayerNorms(torch.nn.ModuleList):
    """One RMSNorm per text-encoder layer (ComfyUI's txt_norm.0 ..): the context's features are the layers side by
    side; each slice is normed by its own weight."""

    def __init__(self, layers: int, width: int):
        super().__init__(torch.nn.RMSNorm(width, eps=TEXT_EPS) for _ in range(layers))

    def forward(self, text: torch.Tensor) -> torch.Tensor:
        return torch.cat([norm(part) for norm, part in zip(self, text.chunk(len(self), dim=-1))], dim=-1)


def build_model(model_class, config: dict, dtypes: WeightDtypes):
    layers, mlp_width = (config[key] for key in LENS_KEYS)

    def change(model) -> None:
        width = model.config.num_attention_heads * model.config.attention_head_dim
        model.txt_norm = TextLayerNorms(layers, model.config.joint_attention_dim // layers)
        for block in model.transformer_blocks:
            block.img_mlp, block.txt_mlp = GateMLP(width, mlp_width), GateMLP(width, mlp_width)
            for name in BLOCK_NORMS:
                setattr(block, name, torch.nn.RMSNorm(width, eps=BLOCK_EPS))
            for name in QK_NORMS:
                getattr(block.attn, name).eps = ATTENTION_EPS
    return build_empty_model(model_class, {k: v for k, v in config.items() if k not in LENS_KEYS}, dtypes,
                             change=change)
