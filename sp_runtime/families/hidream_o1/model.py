"""HiDream-O1's transformer as our own module (diffusers has no class for it). Parameter names are ComfyUI's, the
decoder's `language_model.` aside (keys.py). The top-level class is a diffusers ModelMixin (from_config, layerwise
fp8 casting), made by transformer_class() on first use: the family package imports no diffusers at import time.

Facts (ComfyUI's comfy/ldm/hidream_o1 and comfy/text_encoders/llama.py): a Qwen3-VL-8B text decoder (token embedding,
decoder layers of pre-RMSNorm self-attention and a SiLU-gated MLP, a final RMSNorm) over one sequence [text | image];
attention has bias-free q / k / v / o projections, grouped key / value heads, per-head RMSNorm on q and k, then the
interleaved MRoPE (split-half pairs). The image is raw RGB in 32 x 32 patches (features (c, py, px)), embedded by a
bias-free Linear to a bottleneck then a Linear to the width (x_embedder.proj1 / proj2); final_layer2.linear maps the
final-normed image tokens back to patches. t_embedder1 is the DiT TimestepEmbedder (256 sinusoids, cos then sin,
max period 10000, Linear-SiLU-Linear) whose output replaces the embedding of every <|tms_token|>. `visual` is the
vision tower of reference images (vision.py), built when the file holds one (config `vision`).
"""
from __future__ import annotations

import math

from functools import lru_cache

import torch
from torch import nn

FREQUENCIES = 256


class SelfAttention(nn.Module):
    """q / k / v / o projections and q / k norms; the attention itself is the processor's (the executor sets
    sp.processor.SPAttnProcessor: plan.project, plan.finish)."""

    def __init__(self, width: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(width, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, width, bias=False)
        self.q_norm, self.k_norm = nn.RMSNorm(head_dim, eps=eps), nn.RMSNorm(head_dim, eps=eps)
        self.processor = None

    def set_processor(self, processor) -> None:
        self.processor = processor

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.processor is None:
            raise RuntimeError("HiDream-O1's attention runs inside the sequence-parallel executor only")
        return self.processor(self, hidden)


class GatedMLP(nn.Module):
    def __init__(self, width: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(width, inner, bias=False)
        self.up_proj = nn.Linear(width, inner, bias=False)
        self.down_proj = nn.Linear(inner, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, width: int, inner: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.self_attn = SelfAttention(width, heads, kv_heads, head_dim, eps)
        self.mlp = GatedMLP(width, inner)
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(width, eps=eps), nn.RMSNorm(width, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class TimestepEmbedder(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(FREQUENCIES, width), nn.SiLU(), nn.Linear(width, width))

    def forward(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        half = FREQUENCIES // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]
        return self.mlp(torch.cat([args.cos(), args.sin()], dim=-1).to(dtype))


class PatchEmbed(nn.Module):
    def __init__(self, features: int, bottleneck: int, width: int):
        super().__init__()
        self.proj1 = nn.Linear(features, bottleneck, bias=False)
        self.proj2 = nn.Linear(bottleneck, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj2(self.proj1(x))


class FinalLayer(nn.Module):
    def __init__(self, width: int, features: int):
        super().__init__()
        self.linear = nn.Linear(width, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


@lru_cache(maxsize=1)
def transformer_class() -> type:
    """The HiDreamO1Transformer class (made once)."""
    from diffusers.configuration_utils import ConfigMixin, register_to_config
    from diffusers.models.modeling_utils import ModelMixin

    class HiDreamO1Transformer(ModelMixin, ConfigMixin):
        """The decoder and the pixel-patch shims; the executor runs it (plan.py), no forward of its own."""

        _no_split_modules = ["DecoderLayer"]

        @register_to_config
        def __init__(self, vocab_size: int = 151936, hidden_size: int = 4096, intermediate_size: int = 12288,
                     num_layers: int = 36, num_attention_heads: int = 32, num_key_value_heads: int = 8,
                     head_dim: int = 128, patch_size: int = 32, bottleneck_dim: int = 1024,
                     rope_theta: float = 5_000_000.0, mrope_section: tuple = (24, 20, 20), rms_norm_eps: float = 1e-6,
                     tms_token_id: int = 151673, in_channels: int = 3, vision: dict = None):
            super().__init__()
            features = in_channels * patch_size * patch_size
            self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
            self.layers = nn.ModuleList(DecoderLayer(hidden_size, intermediate_size, num_attention_heads,
                                                     num_key_value_heads, head_dim, rms_norm_eps)
                                        for _ in range(num_layers))
            self.norm = nn.RMSNorm(hidden_size, eps=rms_norm_eps)
            self.t_embedder1 = TimestepEmbedder(hidden_size)
            self.x_embedder = PatchEmbed(features, bottleneck_dim, hidden_size)
            self.final_layer2 = FinalLayer(hidden_size, features)
            if vision:
                from .vision import VisionTower
                self.visual = VisionTower(**vision)

    return HiDreamO1Transformer
