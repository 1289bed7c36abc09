"""Plain single-device attention in diffusers' [batch, sequence, heads, head_dim] layout, through the selected
backend (SDPA by default)."""
from __future__ import annotations

from typing import Optional

import torch

from .backends import attend


def local_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    mask: Optional[torch.Tensor] = None, scale: Optional[float] = None) -> torch.Tensor:
    """SDPA over [B, S, H, D] tensors; mask is a bool key mask [B, S_kv] (True = attend) or an SDPA mask."""
    if mask is not None and mask.dim() == 2:
        mask = mask[:, None, None, :]
    out = attend(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), mask, scale)
    return out.transpose(1, 2)


def joint_local_attention(query, key, value, text=None, text_mask=None, text_first=True, scale=None):
    """Joint text + image attention on one device: the reference the parallel versions must equal."""
    if text is None:
        return local_attention(query, key, value, scale=scale), None
    length = text[0].shape[1]
    parts = [(t, x) if text_first else (x, t) for t, x in zip(text, (query, key, value))]
    q, k, v = (torch.cat(pair, dim=1) for pair in parts)
    mask = None if text_mask is None else _joint_mask(text_mask, query.shape[1], text_first)
    out = local_attention(q, k, v, mask=mask, scale=scale)
    if text_first:
        return out[:, length:], out[:, :length]
    return out[:, :query.shape[1]], out[:, query.shape[1]:]


def _joint_mask(text_mask: torch.Tensor, image_tokens: int, text_first: bool) -> torch.Tensor:
    image = text_mask.new_ones(text_mask.shape[0], image_tokens, dtype=torch.bool)
    parts = (text_mask.bool(), image) if text_first else (image, text_mask.bool())
    return torch.cat(parts, dim=1)
