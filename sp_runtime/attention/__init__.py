"""Sequence-parallel attention: Ulysses (and, on the Ring axis, ring attention) exact for any shape."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..groups import SeqParallel
from .local import joint_local_attention, local_attention
from .shards import SeqShards
from .ulysses import ulysses_attention

__all__ = ["SeqShards", "local_attention", "joint_local_attention", "sp_attention", "ulysses_attention"]


def sp_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, seq: SeqParallel,
                 shards: SeqShards, text: Optional[Sequence[torch.Tensor]] = None,
                 text_mask: Optional[torch.Tensor] = None, text_first: bool = True,
                 scale: Optional[float] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Attention of this rank's tokens [B, n, H, D] over the whole split sequence, plus replicated joint text.

    Returns (output for this rank's tokens [B, n, H, D], text output [B, L, H, D] or None).
    """
    if shards.degree != seq.degree:
        raise ValueError(f"the sequence is split in {shards.degree} shards but the layout has {seq.degree} ranks "
                         f"per sequence")
    if seq.ring_degree > 1:
        raise NotImplementedError("ring attention is not available yet")
    if seq.ulysses_degree == 1:
        return joint_local_attention(query, key, value, text, text_mask, text_first, scale)
    return ulysses_attention(query, key, value, seq.ulysses_group, seq.ulysses_rank, shards, text, text_mask,
                             text_first, scale)
