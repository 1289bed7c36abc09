"""Anima's text path: its LLM adapter (our module, in ComfyUI's key names `llm_adapter.*`), which turns the Qwen3
hidden states and the T5 token ids of a prompt into the DiT's context, and the packing of those adapter inputs into
one tensor, which is how they travel from ComfyUI's host (it holds no weights) to the workers.

Facts (ComfyUI's comfy/ldm/anima/model.py): the T5 ids are embedded (a vocabulary of 32128), then blocks of
self-attention, cross-attention to the Qwen3 states and a GELU MLP, each pre-normed (RMSNorm, eps 1e-6) and added;
attention has 16 heads, per-head RMS norms on q and k, bias-free projections, rotary positions (theta 10000, halves
rotated together) from 0 on the ids for q and self-attention k, from 0 on the Qwen3 tokens for cross-attention k;
out_proj then RMSNorm. The output is multiplied by the T5 token weights and padded with zero tokens to 512.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

HEADS = 16
EPS = 1e-6
ROPE_THETA = 10000.0
CONTEXT_TOKENS = 512  # the adapter's output is padded with zero tokens to at least this many
# the packed adapter inputs: a header row [MAGIC..., Lq digits, Lt digits], Lq Qwen3 rows, Lt rows [id digits,
# weight]; small integers only, so the packing survives ComfyUI's casts to bf16 / fp16
MAGIC = (13.0, -7.0, 29.0)
BASE, DIGITS = 32, 3
PACK_ROWS = 512  # packed rows are rounded up to a multiple (CFG halves of usual prompts batch together)


class Attention(nn.Module):
    """Bias-free q / k / v / o projections, per-head RMS norms on q and k."""

    def __init__(self, dim: int, context_dim: int):
        super().__init__()
        self.q_proj, self.o_proj = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.k_proj, self.v_proj = nn.Linear(context_dim, dim, bias=False), nn.Linear(context_dim, dim, bias=False)
        self.q_norm, self.k_norm = nn.RMSNorm(dim // HEADS, eps=EPS), nn.RMSNorm(dim // HEADS, eps=EPS)

    def forward(self, x, context, rotary_q, rotary_k) -> torch.Tensor:
        query = rotate(self.q_norm(self.q_proj(x).unflatten(-1, (HEADS, -1))), *rotary_q)
        key = rotate(self.k_norm(self.k_proj(context).unflatten(-1, (HEADS, -1))), *rotary_k)
        value = self.v_proj(context).unflatten(-1, (HEADS, -1))
        out = nn.functional.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2),
                                                         value.transpose(1, 2))
        return self.o_proj(out.transpose(1, 2).flatten(2))


class Block(nn.Module):
    def __init__(self, dim: int, context_dim: int, self_attention: bool = True, mlp_ratio: float = 4.0):
        super().__init__()
        if self_attention:
            self.norm_self_attn, self.self_attn = nn.RMSNorm(dim, eps=EPS), Attention(dim, dim)
        self.norm_cross_attn, self.cross_attn = nn.RMSNorm(dim, eps=EPS), Attention(dim, context_dim)
        self.norm_mlp = nn.RMSNorm(dim, eps=EPS)
        self.mlp = nn.Sequential(nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(), nn.Linear(int(dim * mlp_ratio), dim))

    def forward(self, x, context, rotary_x, rotary_context) -> torch.Tensor:
        if hasattr(self, "self_attn"):
            normed = self.norm_self_attn(x)
            x = x + self.self_attn(normed, normed, rotary_x, rotary_x)
        x = x + self.cross_attn(self.norm_cross_attn(x), context, rotary_x, rotary_context)
        return x + self.mlp(self.norm_mlp(x))


class LLMAdapter(nn.Module):
    """T5 ids [B, Lt] and Qwen3 states [B, Lq, context_dim] -> the DiT's context [B, Lt, dim]."""

    def __init__(self, vocabulary: int, dim: int, context_dim: int, layers: int, self_attention: bool = True):
        super().__init__()
        self.embed = nn.Embedding(vocabulary, dim)
        self.blocks = nn.ModuleList(Block(dim, context_dim, self_attention) for _ in range(layers))
        self.out_proj = nn.Linear(dim, dim)
        self.norm = nn.RMSNorm(dim, eps=EPS)

    def forward(self, text: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids).to(text.dtype)
        head_dim = x.shape[-1] // HEADS
        rotary_x = rotary_table(ids.shape[1], head_dim, x)
        rotary_context = rotary_table(text.shape[1], head_dim, x)
        for block in self.blocks:
            x = block(x, text, rotary_x, rotary_context)
        return self.norm(self.out_proj(x))


def rotary_table(length: int, head_dim: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [L, 1, head_dim] of positions 0..L-1 (float32 maths, then the states' dtype)."""
    inverse = 1.0 / ROPE_THETA ** (torch.arange(0, head_dim, 2, device=like.device).float() / head_dim)
    angles = torch.arange(length, device=like.device).float()[:, None] * inverse
    angles = torch.cat([angles, angles], dim=-1)[:, None]
    return angles.cos().to(like.dtype), angles.sin().to(like.dtype)


def rotate(tensor: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[B, L, H, D] rotated with channels i and i + D/2 as a pair."""
    first, second = tensor.chunk(2, dim=-1)
    return tensor * cos + torch.cat([-second, first], dim=-1) * sin


def context(adapter: LLMAdapter, text: torch.Tensor, ids: torch.Tensor,
            weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """ComfyUI's Anima preprocess_text_embeds: the adapter's output x the token weights, padded to 512 tokens."""
    out = adapter(text, ids)
    if weights is not None:
        out = out * weights.reshape(*ids.shape, 1).to(out.dtype)
    return nn.functional.pad(out, (0, 0, 0, max(0, CONTEXT_TOKENS - out.shape[1])))


# ---- the adapter's inputs packed into one tensor (host -> workers) ----

def pack(text_embeds: torch.Tensor, text_ids: torch.Tensor, t5xxl_weights: Optional[torch.Tensor] = None
         ) -> torch.Tensor:
    """The host's preprocess_text_embeds (ComfyUI's Anima calls it in extra_conds): text [1, Lq, C], ids [1, Lt],
    weights [1, Lt, 1] -> one tensor [1, R, C] that ComfyUI's conditioning carries to the call as c_crossattn."""
    if text_embeds.shape[0] != 1 or text_ids.shape[0] != 1 or text_embeds.shape[-1] < len(MAGIC) + 2 * DIGITS:
        raise ValueError(f"Anima's packed text takes one prompt [1, L, >= 9] with ids [1, Lt]; got "
                         f"{list(text_embeds.shape)} and {list(text_ids.shape)}")
    ids = text_ids.reshape(-1).long()
    lengths = (text_embeds.shape[1], ids.shape[0])
    rows = -(-(1 + sum(lengths)) // PACK_ROWS) * PACK_ROWS
    packed = text_embeds.new_zeros(1, rows, text_embeds.shape[-1])
    packed[0, 0, :len(MAGIC) + 2 * DIGITS] = torch.tensor([*MAGIC, *digits(lengths[0]), *digits(lengths[1])])
    packed[0, 1:1 + lengths[0]] = text_embeds[0]
    id_rows = packed[0, 1 + lengths[0]:1 + sum(lengths)]
    id_rows[:, :DIGITS] = torch.stack([ids // BASE ** power % BASE for power in range(DIGITS)], dim=-1).to(packed)
    id_rows[:, DIGITS] = 1.0 if t5xxl_weights is None else t5xxl_weights.reshape(-1).to(packed)
    return packed


def digits(value: int) -> list[int]:
    if not 0 <= value < BASE ** DIGITS:
        raise ValueError(f"Anima's packed text holds at most {BASE ** DIGITS - 1} tokens per part; got {value}")
    return [value // BASE ** power % BASE for power in range(DIGITS)]


def is_packed(tensor: torch.Tensor) -> bool:
    """Whether every item of [B, R, C] is a packed prompt (its header row)."""
    if tensor.dim() != 3 or tensor.shape[-1] < len(MAGIC) + 2 * DIGITS:
        return False
    magic = tensor.new_tensor(MAGIC)
    return bool((tensor[:, 0, :len(MAGIC)] == magic).all())


def unpack(item: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One packed prompt [R, C] -> text [1, Lq, C], ids [1, Lt] (long), weights [1, Lt, 1]."""
    header = item[0, len(MAGIC):len(MAGIC) + 2 * DIGITS].round().long().tolist()
    scale = [BASE ** power for power in range(DIGITS)]
    text_length = sum(d * s for d, s in zip(header[:DIGITS], scale))
    id_length = sum(d * s for d, s in zip(header[DIGITS:], scale))
    if 1 + text_length + id_length > item.shape[0]:
        raise ValueError(f"Anima packed text is damaged: {text_length} + {id_length} tokens in {item.shape[0]} rows")
    id_rows = item[1 + text_length:1 + text_length + id_length]
    ids = (id_rows[:, :DIGITS].round().long() * torch.tensor(scale, device=item.device)).sum(-1)
    return item[None, 1:1 + text_length], ids[None], id_rows[None, :, DIGITS:DIGITS + 1]
