"""Sequence-parallel attention: Ulysses, Ring and their hybrid, exact for any sequence length and head count."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..groups import SeqParallel
from .gather import gather_rows, gather_tokens
from .hybrid import hybrid_attention
from .key_shards import attention_over_key_shards
from .local import joint_local_attention, local_attention
from .masks import FunctionMask, KeyValues, Segment, SegmentMask, SequenceMask, TILE_ROWS, whole_attention
from .ring import ring_attention
from .shards import SeqShards
from .ulysses import ulysses_attention

__all__ = ["SeqShards", "SequenceMask", "FunctionMask", "KeyValues", "Segment", "SegmentMask",
           "attention_over_key_shards", "gather_rows", "gather_tokens", "local_attention", "joint_local_attention",
           "sp_attention", "ulysses_attention", "ring_attention", "hybrid_attention"]


def sp_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, seq: SeqParallel,
                 shards: SeqShards, text: Optional[Sequence[torch.Tensor]] = None,
                 text_mask: Optional[torch.Tensor] = None, text_first: bool = True,
                 scale: Optional[float] = None, mask: Optional[SequenceMask] = None,
                 extra: Optional[KeyValues] = None, keep: Optional[KeyValues] = None
                 ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Attention of this rank's tokens [B, n, H, D] over the whole split sequence, plus replicated joint text.

    mask: which keys each query sees over the global sequence (attention.masks), applied exactly under every
    layout; extra: keys / values of another branch (KeyValues, split like a stream) every query also attends to,
    after the sequence's own keys; neither together with text; keep: a KeyValues of this call's key / value, in which
    Ulysses keeps them as exchanged (KeyValues.heads) for a later call taking it as `extra`. Replicated queries over
    split keys (merged by log-sum-exp): attention_over_key_shards.

    Dispatches on the layout: one rank -> local SDPA; Ulysses only -> ulysses_attention; Ring only ->
    ring_attention; both -> hybrid_attention. Returns (output for this rank's tokens [B, n, H, D], text output
    [B, L, H, D] or None).
    """
    if shards.degree != seq.degree:
        raise ValueError(f"the sequence is split in {shards.degree} shards but the layout has {seq.degree} ranks "
                         f"per sequence")
    if query.shape[1] != shards.sizes[seq.rank]:
        raise ValueError(f"sequence rank {seq.rank} got {query.shape[1]} tokens but its shard has "
                         f"{shards.sizes[seq.rank]} (shards {shards.sizes}): pass tokens shards.range(seq.rank)")
    if (mask is not None or extra is not None) and text is not None:
        raise ValueError("sp_attention takes joint text or a sequence mask / extra keys, not both: put the text in "
                         "the sequence")
    if seq.degree == 1:
        if mask is None and extra is None:
            return joint_local_attention(query, key, value, text, text_mask, text_first, scale)
        if extra is not None:
            key, value = torch.cat([key, extra.key], dim=1), torch.cat([value, extra.value], dim=1)
        out = whole_attention(mask, *(t.transpose(1, 2) for t in (query, key, value)), scale)
        return out.transpose(1, 2), None
    return _distributed(query, key, value, seq, shards, text, text_mask, text_first, scale, mask, extra, keep)


def leave_exchanges_to_eager() -> None:
    """Compiled blocks (sp_runtime.compile) call this first: the distributed path then runs in eager mode (a
    graph break per attention). Not a decorator: torch.compiler.disable imports torch._dynamo, ~2 s of CPU that
    every rank would pay at import whether it compiles or not."""
    global _distributed
    _distributed = torch.compiler.disable(_distributed_attention)


def _distributed_attention(query, key, value, seq, shards, text, text_mask, text_first, scale, mask, extra, keep):
    if seq.ring_degree > 1:
        core = ring_attention if seq.ulysses_degree == 1 else hybrid_attention
        return core(query, key, value, seq, shards, text, text_mask, text_first, scale, mask, extra)
    return ulysses_attention(query, key, value, seq.ulysses_group, seq.ulysses_rank, shards, text, text_mask,
                             text_first, scale, mask, extra, keep)


_distributed = _distributed_attention  # leave_exchanges_to_eager() swaps in the compiler-disabled one
