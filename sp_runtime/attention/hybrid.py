"""The Ulysses x Ring hybrid (USP): Ulysses inside each ring block, ring attention between the blocks.

Ring block r holds the Ulysses shards r*U .. r*U+U-1 of the sequence (SeqParallel.rank = ring_rank * U +
ulysses_rank). Inside the block one fused all-to-all gives each rank all the block's tokens for its heads, the ring
passes those heads' key/value blocks between the blocks, and one all-to-all brings the outputs back. Text is cut
by heads locally (no communication) and comes back with all heads through the return exchange, as in Ulysses.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..groups import SeqParallel
from .ring import gather_shards, ring_attention_heads
from .shards import SeqShards
from .ulysses import exchange_to_heads, exchange_to_tokens, extra_to_heads, gather_sequence, text_heads


def hybrid_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, seq: SeqParallel,
                     shards: SeqShards, text: Optional[Sequence[torch.Tensor]] = None,
                     text_mask: Optional[torch.Tensor] = None, text_first: bool = True,
                     scale: Optional[float] = None, mask=None,
                     extra=None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """sp_attention for ulysses_degree > 1 and ring_degree > 1; [B, n, H, D] in, [B, n, H, D] out.

    text_first does not change the result (see ring_attention).
    """
    degree = seq.ulysses_degree
    block = shards.block(seq.ring_rank * degree, degree)
    block_sizes = tuple(shards.block(ring_rank * degree, degree).total for ring_rank in range(seq.ring_degree))
    received = exchange_to_heads(query, key, value, seq.ulysses_group, block)
    q, k, v = gather_sequence(received, block.sizes)
    text_local = None if text is None else tuple(text_heads(text, seq.ulysses_rank, degree))
    extra_kv = None
    if extra is not None:  # this Ulysses group's heads of every extra token: its block, then the ring's
        blocks = [extra.shards.block(ring_rank * degree, degree) for ring_rank in range(seq.ring_degree)]
        extra_kv = extra_to_heads(extra, seq.ulysses_group, blocks[seq.ring_rank])
        ring_blocks = SeqShards(extra.shards.total, tuple(b.total for b in blocks))
        extra_kv = tuple(gather_shards(t, ring_blocks, seq.ring_group) for t in extra_kv)
    image, text_out = ring_attention_heads(q, k, v, seq, block_sizes, text_local, text_mask, scale, mask, extra_kv)
    return exchange_to_tokens(image, text_out, seq.ulysses_group, block, query.shape[1], query.shape[2])
