"""Ulysses attention: one fused all-to-all turns "my tokens, all heads" into "all tokens, my heads" and one turns it back.

Exact for any sequence length (shards are padded to the longest for the exchange and the padding is trimmed out
before attention) and any head count (heads are zero-padded to a multiple of the degree; those extra heads cost
ceil(H / P) * P / H - 1 more attention and exchange work, e.g. 33% for 3 heads on 4 ranks, and are dropped).
Joint text tokens are replicated: each rank cuts its heads out locally and the return exchange carries the text
output so every rank ends with all heads of the text.
The two exchanges are public (exchange_to_heads, exchange_to_tokens) for the Ulysses x Ring hybrid. With the
model's overlap option, the return exchange goes in two head halves, the first in flight while the second attends;
with fp8_exchange q, k, v travel as 8-bit and the output as 12-bit codes (sp_runtime.attention.fp8_exchange).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .backends import attend
from .fp8_exchange import INPUT_CODEC, OUTPUT_CODEC, AllToAll, Codec
from .local import _joint_mask
from .masks import whole_attention
from .options import current
from .shards import SeqShards


def _heads_per_rank(heads: int, degree: int) -> int:
    return -(-heads // degree)


def _pad(x: torch.Tensor, tokens: int, heads: int) -> torch.Tensor:
    """Zero-pad a [B, S, H, D] tensor to `tokens` tokens and `heads` heads (no copy when nothing to pad)."""
    pad_tokens, pad_heads = tokens - x.shape[1], heads - x.shape[2]
    if pad_tokens == 0 and pad_heads == 0:
        return x
    return F.pad(x, (0, 0, 0, pad_heads, 0, pad_tokens))


def _all_to_all(send: torch.Tensor, group, codec: Codec, async_op: bool = False) -> AllToAll:
    return AllToAll(send, group, codec if current().fp8_exchange else None, async_op=async_op)


def _head_parts(heads: int) -> list[slice]:
    """This rank's heads in two halves when overlap is on (the first half's output travels while the second half
    attends), else all at once."""
    if not current().overlap or heads < 2:
        return [slice(0, heads)]
    return [slice(0, heads // 2), slice(heads // 2, heads)]


def _gather_sequence(recv: torch.Tensor, sizes: Sequence[int], text: Optional[torch.Tensor],
                     text_first: bool) -> torch.Tensor:
    """[P, 3, B, h, chunk, D] from P shards -> [3, B, h, S, D] with padding trimmed and text joined, in one copy."""
    parts = [recv[source, ..., :size, :] for source, size in enumerate(sizes)]
    if text is not None:
        parts = [text, *parts] if text_first else [*parts, text]
    return torch.cat(parts, dim=3)


def text_heads(text: Sequence[torch.Tensor], rank: int, degree: int) -> torch.Tensor:
    """This rank's heads of replicated text q, k, v: [3, B, h, L, D] (no communication)."""
    heads = _heads_per_rank(text[0].shape[2], degree)
    padded_heads = heads * degree
    mine = [_pad(t, t.shape[1], padded_heads)[:, :, rank * heads:(rank + 1) * heads] for t in text]
    return torch.stack(mine).transpose(2, 3)  # copies this rank's heads only


def ulysses_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group, rank: int,
                      shards: SeqShards, text: Optional[Sequence[torch.Tensor]] = None,
                      text_mask: Optional[torch.Tensor] = None, text_first: bool = True,
                      scale: Optional[float] = None, mask=None, extra=None, keep=None
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Attention over a sequence split across `group` (shards.sizes[r] tokens on rank r).

    query/key/value: [B, n_local, H, D] local tokens with all heads; text: optional replicated (q, k, v) each
    [B, L, H, D]; text_mask: optional bool [B, L], True = attend; mask: a SequenceMask (attention.masks) over the
    whole sequence instead of text; extra: KeyValues every query also attends to (exchanged unless it holds them
    as exchanged: extra.heads); keep: a KeyValues whose heads get this call's exchanged key / value. Returns (local
    output [B, n_local, H, D], text output [B, L, H, D] or None).
    """
    heads = query.shape[2]
    recv = exchange_to_heads(query, key, value, group, shards)
    text_local = None if text is None else text_heads(text, rank, shards.degree)
    q, k, v = _gather_sequence(recv, shards.sizes, text_local, text_first)
    if keep is not None:
        keep.heads = (k, v)
    if extra is not None:
        extra_key, extra_value = extra.heads or extra_to_heads(extra, group)
        k, v = torch.cat([k, extra_key], dim=2), torch.cat([v, extra_value], dim=2)
    sequence_mask, mask = mask, None
    if text_mask is not None:
        mask = _joint_mask(text_mask, shards.total, text_first)[:, None, None, :]
    text_len = 0 if text is None else text[0].shape[1]
    image_start = text_len if text_first else 0
    text_start = 0 if text_first else shards.total
    exchanges = []
    for part in _head_parts(q.shape[1]):
        if sequence_mask is not None or extra is not None:
            out = whole_attention(sequence_mask, q[:, part], k[:, part], v[:, part], scale)
        else:
            out = attend(q[:, part], k[:, part], v[:, part], mask, scale)  # [B, h, L + N, D]
        image = out[:, :, image_start:image_start + shards.total]
        text_out = out[:, :, text_start:text_start + text_len] if text is not None else None
        exchanges.append(_all_to_all(_scatter_sequence(image, text_out, shards), group, OUTPUT_CODEC,
                                      async_op=True))
    parts = [exchange.result() for exchange in exchanges]
    received = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return _split_received(received, shards, query.shape[1], heads, text is not None)


def exchange_to_heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group,
                      shards: SeqShards) -> torch.Tensor:
    """First half of Ulysses: one fused all-to-all of q, k, v from "my tokens, all heads" to "all tokens, my heads".

    Returns the received buffer [P (source shard), 3, B, h, chunk, D]; shard r's tokens are [r, ..., :sizes[r], :].
    """
    return _exchange((query, key, value), group, shards)


def _exchange(tensors, group, shards: SeqShards) -> torch.Tensor:
    """[B, n, H, D] tensors of this rank's tokens -> [P (source shard), len(tensors), B, h, chunk, D]."""
    degree = shards.degree
    batch, _, heads, head_dim = tensors[0].shape
    heads_here = _heads_per_rank(heads, degree)
    padded_heads = heads_here * degree
    chunk = shards.chunk
    # [P (destination's heads), T, B, h, chunk, D]: one contiguous send buffer for all tensors together.
    per_destination = [_pad(x, chunk, padded_heads).view(batch, chunk, degree, heads_here, head_dim)
                       .permute(2, 0, 3, 1, 4) for x in tensors]
    return _all_to_all(torch.stack(per_destination, dim=1), group, INPUT_CODEC).result()


def extra_to_heads(extra, group, shards: Optional[SeqShards] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A KeyValues stream (attention.masks) to "all its tokens, my heads": (key, value) [B, h, E, D]; `shards`
    replaces extra.shards (one Ulysses group's block of them inside the hybrid)."""
    shards = shards or extra.shards
    key, value = gather_sequence(_exchange((extra.key, extra.value), group, shards), shards.sizes)
    return key, value


def gather_sequence(recv: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """exchange_to_heads' buffer -> [3, B, h, S, D]: q, k, v of every shard's tokens, padding trimmed."""
    return _gather_sequence(recv, sizes, None, True)


def exchange_to_tokens(image: torch.Tensor, text: Optional[torch.Tensor], group, shards: SeqShards,
                       local_tokens: int, heads: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Second half of Ulysses: one all-to-all from "all tokens, my heads" back to "my tokens, all heads".

    image: [B, h, S, D] output of this rank's heads for the whole sequence; text: [B, h, L, D] or None (sent to
    every rank, so each ends with all heads of the text). Returns ([B, local_tokens, H, D], [B, L, H, D] or None).
    """
    received = _all_to_all(_scatter_sequence(image, text, shards), group, OUTPUT_CODEC).result()
    return _split_received(received, shards, local_tokens, heads, text is not None)


def _split_received(received: torch.Tensor, shards: SeqShards, local_tokens: int, heads: int,
                    has_text: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """[P (source's heads), B, h, chunk + L, D] -> (image [B, local_tokens, H, D], text [B, L, H, D] or None)."""
    image_out = _merge_heads(received[:, :, :, :local_tokens], heads)
    text_out = _merge_heads(received[:, :, :, shards.chunk:], heads) if has_text else None
    return image_out, text_out


def _scatter_sequence(image: torch.Tensor, text: Optional[torch.Tensor], shards: SeqShards) -> torch.Tensor:
    """[B, h, S, D] image output (+ [B, h, L, D] text) -> [P, B, h, chunk + L, D]: each destination's tokens, then
    all text."""
    batch, heads, _, head_dim = image.shape
    chunk = shards.chunk
    text_len = 0 if text is None else text.shape[2]
    send = image.new_empty(shards.degree, batch, heads, chunk + text_len, head_dim)
    if shards.even:
        send[:, :, :, :chunk] = image.unflatten(2, (shards.degree, chunk)).permute(2, 0, 1, 3, 4)
    else:
        for destination, size in enumerate(shards.sizes):
            start = shards.offset(destination)
            send[destination, :, :, :size] = image[:, :, start:start + size]
    if text_len:
        send[:, :, :, chunk:] = text.unsqueeze(0)
    return send


def _merge_heads(parts: torch.Tensor, heads: int) -> torch.Tensor:
    """[P, B, h, n, D] (head groups from every rank) -> [B, n, H, D], dropping padded heads."""
    degree, batch, heads_here, tokens, head_dim = parts.shape
    merged = parts.permute(1, 3, 0, 2, 4).reshape(batch, tokens, degree * heads_here, head_dim)
    return merged if degree * heads_here == heads else merged[:, :, :heads].contiguous()
