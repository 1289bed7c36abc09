"""Ring attention: each rank keeps its query block while the key/value blocks travel once around the ring group.

Per step one batched isend/irecv (k and v packed in one buffer) moves the blocks one rank along the ring while the
attention of the block in hand runs; the partial outputs merge exactly by their log-sum-exp (online softmax).
Blocks may differ in size (even be empty): every message is padded to the largest block and trimmed on receipt,
so padding is never attended. Joint text (replicated on every rank) is exact too: its keys join the first
non-empty block this rank sees (attended once, with the text key mask there), and its query rows are split over
the ring like the image rows, then all-gathered so every rank returns the whole text output.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..groups import SeqParallel
from .gather import all_gather_into
from .lse import LseMerger, attention_with_lse, key_padding_bias
from .masks import masked_block_with_lse
from .shards import SeqShards


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, seq: SeqParallel,
                   shards: SeqShards, text: Optional[Sequence[torch.Tensor]] = None,
                   text_mask: Optional[torch.Tensor] = None, text_first: bool = True,
                   scale: Optional[float] = None, mask=None, extra=None
                   ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """sp_attention for a pure ring layout (ulysses_degree 1), in [B, n, H, D] like the other cores.

    text_first does not change the result: the order of the keys does not matter to softmax, and the text output
    comes back separately.
    """
    heads_first = tuple(x.transpose(1, 2) for x in (query, key, value))
    text_heads_first = None if text is None else tuple(t.transpose(1, 2) for t in text)
    extra_kv = None
    if extra is not None:  # every rank's extra keys / values, all heads (one all-gather each)
        extra_kv = tuple(gather_shards(t.transpose(1, 2), extra.shards, seq.ring_group)
                         for t in (extra.key, extra.value))
    image, text_out = ring_attention_heads(*heads_first, seq, shards.sizes, text_heads_first, text_mask, scale, mask,
                                           extra_kv)
    text_out = None if text_out is None else text_out.transpose(1, 2).contiguous()
    return image.transpose(1, 2).contiguous(), text_out


def ring_attention_heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, seq: SeqParallel,
                         block_sizes: Sequence[int], text: Optional[Sequence[torch.Tensor]] = None,
                         text_mask: Optional[torch.Tensor] = None,
                         scale: Optional[float] = None, mask=None,
                         extra_kv=None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Ring attention over seq.ring_group in [B, h, n, D] layout (the hybrid calls it on its Ulysses heads).

    query/key/value: this ring rank's block, n = block_sizes[seq.ring_rank]; text: optional replicated (q, k, v)
    each [B, h, L, D]; text_mask: optional bool [B, L], True = attend; mask: a SequenceMask over the blocks in
    ring order (instead of text), applied per query block x key block; extra_kv: (key, value) [B, h, E, D] that
    every query also attends to, after all blocks (global positions from sum(block_sizes)). Returns (output
    [B, h, n, D], text output [B, h, L, D] or None), in the query dtype.
    """
    degree, rank = seq.ring_degree, seq.ring_rank
    if len(block_sizes) != degree or query.shape[2] != block_sizes[rank]:
        raise ValueError(f"ring rank {rank} of {degree} holds {query.shape[2]} tokens but the blocks are "
                         f"{tuple(block_sizes)}: pass this rank's block of the sequence")
    text_rows = SeqShards.balanced(0 if text is None else text[0].shape[2], degree)
    rows_lo, rows_hi = text_rows.range(rank)
    queries = query if text is None else torch.cat([text[0][:, :, rows_lo:rows_hi], query], dim=2)
    merger = _attend_ring(queries, _pack(key, value, max(block_sizes)), seq, block_sizes, text, text_mask, scale,
                          mask)
    if extra_kv is not None and queries.shape[2] and extra_kv[0].shape[2]:
        total, rows_lo = sum(block_sizes), sum(block_sizes[:rank])
        _add_masked(merger, mask, queries, *extra_kv, (rows_lo, rows_lo + queries.shape[2]),
                    (total, total + extra_kv[0].shape[2]), scale)

    if merger.out is None:  # no query rows (or, masked, no visible key block) here
        merged = queries.new_empty(queries.shape)
    else:
        merged = merger.out.to(query.dtype)
    rows = rows_hi - rows_lo
    text_out = None if text is None else gather_shards(merged[:, :, :rows], text_rows, seq.ring_group)
    return merged[:, :, rows:], text_out


def _attend_ring(queries, blocks, seq, block_sizes, text, text_mask, scale, mask=None) -> LseMerger:
    """Attend `queries` to every block as it passes (and to the text keys once); return the merged partials."""
    degree, rank = seq.ring_degree, seq.ring_rank
    starts = [sum(block_sizes[:source]) for source in range(degree)]
    rows = (starts[rank], starts[rank] + block_sizes[rank])
    text_step = _first_nonempty_step(block_sizes, rank) if text is not None else None
    merger = LseMerger()
    shift = _RingShift(seq)
    current, incoming = blocks, torch.empty_like(blocks)
    for step in range(degree):
        pending = shift.start(current, incoming) if step + 1 < degree else []
        size = block_sizes[(rank - step) % degree]
        if queries.shape[2] and (size or step == text_step):
            keys, values = current[0, :, :, :size], current[1, :, :, :size]
            bias = None
            if mask is not None:
                source = (rank - step) % degree
                _add_masked(merger, mask, queries, keys, values, rows, (starts[source], starts[source] + size), scale)
            elif step == text_step:
                keys, values = torch.cat([text[1], keys], dim=2), torch.cat([text[2], values], dim=2)
                bias = None if text_mask is None else _text_bias(text_mask, size, queries.dtype)
            if mask is None:
                merger.add(*attention_with_lse(queries, keys, values, bias, scale))
        for request in pending:
            request.wait()
        current, incoming = incoming, current  # the sent buffer is free again: it receives the next block
    return merger


def _add_masked(merger: LseMerger, mask, queries, keys, values, rows, cols, scale) -> None:
    """The partial result of queries at global rows over keys at cols under `mask` (by query tiles), if any query
    sees a key there."""
    if mask is None:
        merger.add(*attention_with_lse(queries, keys, values, None, scale))
        return
    partial = masked_block_with_lse(mask, queries, keys, values, rows, cols, scale)
    if partial is not None:
        merger.add(*partial)


def _first_nonempty_step(block_sizes: Sequence[int], rank: int) -> int:
    """The step whose block the text keys join: the first non-empty one this rank sees (0 if all are empty).

    Joining a non-empty image block means every query row has an unmasked key in that call even when a prompt's
    text keys are all masked (the LSE kernels give no usable result for a fully masked row).
    """
    degree = len(block_sizes)
    return next((step for step in range(degree) if block_sizes[(rank - step) % degree]), 0)


def _text_bias(text_mask: torch.Tensor, image_keys: int, dtype: torch.dtype) -> torch.Tensor:
    keep = torch.cat([text_mask.bool(), text_mask.new_ones(text_mask.shape[0], image_keys, dtype=torch.bool)], 1)
    return key_padding_bias(keep, dtype)


def _pack(key: torch.Tensor, value: torch.Tensor, chunk: int) -> torch.Tensor:
    """k and v of this rank's block in one [2, B, h, chunk, D] buffer (one message per step), zero-padded."""
    batch, heads, tokens, head_dim = key.shape
    blocks = key.new_empty(2, batch, heads, chunk, head_dim)
    blocks[0, :, :, :tokens] = key
    blocks[1, :, :, :tokens] = value
    if tokens < chunk:
        blocks[:, :, :, tokens:].zero_()
    return blocks


class _RingShift:
    """One ring step: send a buffer to the next rank while receiving the previous rank's into another."""

    def __init__(self, seq: SeqParallel):
        ranks, rank, degree = seq.ring_global_ranks, seq.ring_rank, seq.ring_degree
        self.next, self.previous = ranks[(rank + 1) % degree], ranks[(rank - 1) % degree]
        self.group = seq.ring_group
        self.host_staged = dist.get_backend(self.group) == "gloo"

    def start(self, send: torch.Tensor, receive: torch.Tensor) -> list:
        if self.host_staged and send.device.type != "cpu":
            return [_HostStagedShift(self, send, receive)]
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, self.next, self.group),
                                       dist.P2POp(dist.irecv, receive, self.previous, self.group)])


class _HostStagedShift:
    """A ring step over gloo with device tensors: gloo's send / recv take host memory only (its all-to-all stages
    device tensors itself, its point-to-point does not), so the block goes through host copies."""

    def __init__(self, shift: _RingShift, send: torch.Tensor, receive: torch.Tensor):
        self.receive, self.host_receive = receive, torch.empty(receive.shape, dtype=receive.dtype)
        self.host_send = send.cpu()
        self.works = dist.batch_isend_irecv([dist.P2POp(dist.isend, self.host_send, shift.next, shift.group),
                                             dist.P2POp(dist.irecv, self.host_receive, shift.previous, shift.group)])

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.receive.copy_(self.host_receive)


def gather_shards(rows: torch.Tensor, shards: SeqShards, group) -> torch.Tensor:
    """Every ring rank's rows [B, h, r, D] (shards.sizes[rank] of them) -> all rows [B, h, L, D] in rank order on
    every rank (one all-gather): the text's rows here, Wan Animate 2's keys / values of each ring block."""
    batch, heads, count, head_dim = rows.shape
    chunk = shards.chunk
    if chunk == 0:  # no rows anywhere: nothing to gather
        return rows
    send = rows.new_zeros(batch, heads, chunk, head_dim)
    send[:, :, :count] = rows
    received = send.new_empty(shards.degree * batch, heads, chunk, head_dim)
    all_gather_into(received, send, group=group)
    received = received.view(shards.degree, batch, heads, chunk, head_dim)
    return torch.cat([received[source, :, :, :size] for source, size in enumerate(shards.sizes)], dim=2)
