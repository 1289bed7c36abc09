"""HiDream-O1's vision tower (reference images): the Qwen3-VL ViT whose weights are the checkpoint's `visual.*`, run
whole on every rank (a few hundred tokens per reference, computed once per generation; its output replaces the
<|image_pad|> rows of the prompt). Parameter names are ComfyUI's (comfy/text_encoders/qwen35.py, Qwen35VisionModel).

Facts: pixel_values [N, C * T * P * P] rows (c, t, py, px) of ComfyUI's process_qwen2vl_images, embedded by a Conv3d
with kernel = stride = (T, P, P); a learned S x S position table (S^2 = pos_embed rows) sampled bilinearly at
linspace(0, S - 1, h) x linspace(0, S - 1, w) per image; tokens in merge order (2 x 2 blocks consecutive); blocks
of pre-LayerNorm (eps 1e-6) attention (fused qkv with bias, 2-D rotary: half of each head's rotary pairs from the
row, half from the column, theta 10000, split-half) attending within each image only, and a tanh-GELU MLP; the
merger LayerNorms, joins each 2 x 2 block (merge^2 x width features) and maps it through Linear-GELU-Linear to the
decoder width. The deepstack mergers are unused (ComfyUI drops them).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .detection import VISION_HEADS

ROTARY_THETA = 10000.0
EPS = 1e-6


class VisionAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        tokens = x.shape[0]
        query, key, value = self.qkv(x).reshape(tokens, 3, self.heads, -1).unbind(1)
        query, key = (_rotate(t, cos, sin) for t in (query, key))
        outs = [F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               v.transpose(0, 1)[None])[0].transpose(0, 1)
                for q, k, v in zip(query.split(lengths), key.split(lengths), value.split(lengths))]
        return self.proj(torch.cat(outs).reshape(tokens, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Split-half rotary in float32 (ComfyUI's apply_rope), back in x's dtype."""
    first, second = x.float().chunk(2, dim=-1)
    return (x.float() * cos + torch.cat([-second, first], dim=-1) * sin).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, width: int, inner: int):
        super().__init__()
        self.linear_fc1, self.linear_fc2 = nn.Linear(width, inner), nn.Linear(inner, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, width: int, heads: int, inner: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width, eps=EPS), nn.LayerNorm(width, eps=EPS)
        self.attn, self.mlp = VisionAttention(width, heads), VisionMLP(width, inner)

    def forward(self, x, cos, sin, lengths):
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, channels: int, temporal: int, patch: int, width: int):
        super().__init__()
        self.shape = (channels, temporal, patch, patch)
        self.proj = nn.Conv3d(channels, width, kernel_size=self.shape[1:], stride=self.shape[1:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.reshape(-1, *self.shape).to(self.proj.weight.dtype)).flatten(1)


class Merger(nn.Module):
    def __init__(self, width: int, merge: int, out: int):
        super().__init__()
        self.features = width * merge * merge
        self.norm = nn.LayerNorm(width, eps=EPS)
        self.linear_fc1, self.linear_fc2 = nn.Linear(self.features, self.features), nn.Linear(self.features, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(self.norm(x).reshape(-1, self.features))))


class VisionTower(nn.Module):
    """forward(pixel_values [N, C T P P], grid [[t, h, w] per image]) -> [N / merge^2, decoder width]."""

    def __init__(self, width: int, depth: int, inner: int, patch: int, temporal: int, positions: int, merge: int,
                 out: int, heads: int = VISION_HEADS, channels: int = 3):
        super().__init__()
        self.heads, self.merge, self.side = heads, merge, math.isqrt(positions)
        self.patch_embed = PatchEmbed(channels, temporal, patch, width)
        self.pos_embed = nn.Embedding(positions, width)
        self.blocks = nn.ModuleList(VisionBlock(width, heads, inner) for _ in range(depth))
        self.merger = Merger(width, merge, out)

    def forward(self, pixel_values: torch.Tensor, grid: list[list[int]]) -> torch.Tensor:
        x = self.patch_embed(pixel_values)
        x = x + torch.cat([self._positions(h, w).repeat(t, 1) for t, h, w in grid]).to(x.dtype)
        angles = torch.cat([self._angles(h, w).repeat(t, 1) for t, h, w in grid]).to(x.device)
        angles = torch.cat([angles, angles], dim=-1)[:, None]
        cos, sin = angles.cos(), angles.sin()
        lengths = [h * w for t, h, w in grid for _ in range(t)]
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        return self.merger(x)

    def _merge_order(self, table: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """[h, w, F] -> [h w, F] with each merge x merge block's tokens consecutive."""
        m = self.merge
        return table.reshape(h // m, m, w // m, m, -1).permute(0, 2, 1, 3, 4).reshape(h * w, -1)

    def _positions(self, h: int, w: int) -> torch.Tensor:
        """The S x S table sampled bilinearly at linspace(0, S - 1, h) x linspace(0, S - 1, w), in merge order."""
        weight, side = self.pos_embed.weight, self.side
        rows = torch.linspace(0, side - 1, h, device=weight.device)
        cols = torch.linspace(0, side - 1, w, device=weight.device)
        r0, c0 = rows.int(), cols.int()
        r1, c1 = (r0 + 1).clamp(max=side - 1), (c0 + 1).clamp(max=side - 1)
        dr, dc = (rows - r0)[:, None, None], (cols - c0)[None, :, None]
        table = 0
        for r, c, share in ((r0, c0, (1 - dr) * (1 - dc)), (r0, c1, (1 - dr) * dc), (r1, c0, dr * (1 - dc)),
                            (r1, c1, dr * dc)):  # float32 weights in the table's dtype, as ComfyUI's
            rows_of = weight[(r[:, None] * side + c[None, :]).flatten()].reshape(h, w, -1)
            table = table + rows_of * share.to(weight.dtype)
        return self._merge_order(table, h, w)

    def _angles(self, h: int, w: int) -> torch.Tensor:
        """float32 [h w, head_dim / 2]: each token's row angles then its column angles, in merge order."""
        quarter = self.pos_embed.weight.shape[1] // self.heads // 2
        inv_freq = 1.0 / (ROTARY_THETA ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter))
        rows = torch.arange(h, dtype=torch.float32)[:, None, None] * inv_freq
        cols = torch.arange(w, dtype=torch.float32)[None, :, None] * inv_freq
        table = torch.cat([rows.expand(h, w, -1), cols.expand(h, w, -1)], dim=-1)
        return self._merge_order(table, h, w)
