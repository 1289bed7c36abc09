"""sp_attention's extension point: masks over the global sequence and extra keys / values from another branch.

A mask says which keys each query sees (or an additive bias on their scores) by global token positions, so every
layout applies it exactly (one device and Ulysses on the whole sequence, Ring and the hybrid per query block x key
block). No layout asks a mask for more than TILE_ROWS query rows at a time (split further at the mask's own `cuts`),
so a structured mask never becomes an S x S tensor: per-rank mask memory grows with S, not S x S. SegmentMask is
Qwen-Image 2.1's block-causal mask, FunctionMask any rule of positions. KeyValues are keys / values split like a
stream of their own that every query also attends to (e.g. Wan Animate 2's pose keys), after the sequence's own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
import torch.nn.functional as F

from .backends import attend
from .lse import masked_attention_with_lse

TILE_ROWS = 512  # the most query rows a mask is asked for at once: mask memory <= TILE_ROWS x keys per call


class SequenceMask(Protocol):
    """Which keys each query sees; positions are global (the whole split sequence, in rank order).

    Optional: `cuts`, global positions where the mask's structure changes (query tiles are split there, so a tile
    of rows that all see the same bias can broadcast it over its rows); `attend`, a faster whole-sequence path
    (else query tiles under block())."""

    def block(self, rows: tuple[int, int], cols: tuple[int, int], device: torch.device) -> Optional[torch.Tensor]:
        """For queries rows[0]..rows[1]-1 and keys cols[0]..cols[1]-1, broadcastable to [B or 1, 1, rows, cols]:
        bool (True = attend) or a float additive bias on the scores (-inf = masked), or None when every query sees
        every key there unbiased."""


@dataclass
class KeyValues:
    """Extra keys / values from another branch, split over the sequence ranks like a stream of their own
    (shards.sizes[r] tokens on rank r, each [B, n, H, D]). Every query also attends to them; their global key
    positions follow the sequence's own (total .. total + shards.total), which is where a mask addresses them.
    heads: the same keys / values in Ulysses' layout (every token, this rank's heads: [B, h, E, D]), kept by the
    branch's own sp_attention(keep=...), so Ulysses does not exchange them again."""

    key: torch.Tensor
    value: torch.Tensor
    shards: Any  # SeqShards
    heads: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def values_times(self, factor: float) -> "KeyValues":
        """These keys with the values times `factor` (in every layout held)."""
        heads = None if self.heads is None else (self.heads[0], self.heads[1] * factor)
        return KeyValues(self.key, self.value * factor, self.shards, heads)


def whole_attention(mask: Optional[SequenceMask], query, key, value, scale):
    """Attention of a whole sequence [B, h, S, D] over its keys, plus any extra keys after them, under `mask`: its
    own attend() where it has one (with the extra keys only if it says `with_extra`), else by query tiles."""
    if mask is None:
        return attend(query, key, value, None, scale)
    own = getattr(mask, "attend", None)
    if own is not None and (key.shape[2] == query.shape[2] or getattr(mask, "with_extra", False)):
        return own(query, key, value, scale)
    return tiled_attend(mask, query, key, value, scale)


def query_tiles(mask: SequenceMask, rows: tuple[int, int]) -> list[tuple[int, int]]:
    """rows [lo, hi) in tiles of at most TILE_ROWS, split at the mask's cuts."""
    edges = sorted({rows[0], rows[1], *(cut for cut in getattr(mask, "cuts", ()) if rows[0] < cut < rows[1])})
    tiles = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        tiles += [(start, min(start + TILE_ROWS, hi)) for start in range(lo, hi, TILE_ROWS)]
    return tiles


def _for_sdpa(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return keep if keep.dtype == torch.bool else keep.to(dtype)


def tiled_attend(mask: SequenceMask, query, key, value, scale):
    """Attention of the whole sequence [B, h, S, D] (queries at global rows 0..S-1, keys 0..Sk-1) one query tile at
    a time, each under its block of the mask (one SDPA for the tiles the mask leaves whole)."""
    tiles = query_tiles(mask, (0, query.shape[2]))
    blocks = [mask.block(tile, (0, key.shape[2]), query.device) for tile in tiles]
    if all(block is None for block in blocks):
        return attend(query, key, value, None, scale)
    out = query.new_empty(query.shape)
    for (lo, hi), block in zip(tiles, blocks):
        bias = None if block is None else _for_sdpa(block, query.dtype)
        out[:, :, lo:hi] = attend(query[:, :, lo:hi], key, value, bias, scale)
    return out


def masked_block_with_lse(mask: SequenceMask, query, key, value, rows: tuple[int, int], cols: tuple[int, int],
                          scale) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(out, lse) of queries at global rows [lo, hi) over keys at cols under `mask`, one query tile at a time (the
    Ring step's query block x key block); None when no query sees any key there."""
    outs, lses, seen = [], [], False
    for lo, hi in query_tiles(mask, rows):
        keep = mask.block((lo, hi), cols, query.device)
        tile = query[:, :, lo - rows[0]:hi - rows[0]]
        if keep is not None and not visible(keep):
            outs.append(tile.new_zeros(tile.shape))
            lses.append(torch.full(tile.shape[:3], float("-inf"), device=tile.device))
            continue
        seen = True
        out, lse = masked_attention_with_lse(tile, key, value, keep, scale)
        outs.append(out)
        lses.append(lse.float())
    if not seen:
        return None
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def visible(keep: torch.Tensor) -> bool:
    """Whether a block of a mask (bool or additive bias) lets any query see any key."""
    return bool(keep.any()) if keep.dtype == torch.bool else not bool(torch.isneginf(keep).all())


@dataclass
class FunctionMask:
    """A mask given as a function of global positions: visible(query [nq, 1], key [1, nk]) -> bool, broadcastable
    to [B or 1, 1, nq, nk] (e.g. a sliding window: (query - key).abs() <= w)."""

    visible: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def block(self, rows, cols, device):
        keep = self.visible(torch.arange(*rows, device=device)[:, None], torch.arange(*cols, device=device)[None, :])
        keep = keep.reshape((1,) * (4 - keep.dim()) + tuple(keep.shape))
        return None if bool(keep.all()) else keep


@dataclass(frozen=True)
class Segment:
    """Tokens [start, end) of the sequence: a causal run (text) or a bidirectional block (an image)."""

    start: int
    end: int
    causal: bool


@dataclass
class SegmentMask:
    """Block-causal attention: a segment's queries see every key before the segment's end, a causal segment's
    queries only up to themselves; key_valid (bool [B, S], True = a real key) drops padding keys anywhere."""

    segments: Sequence[Segment]
    key_valid: Optional[torch.Tensor] = None

    def block(self, rows, cols, device):
        query = torch.arange(*rows, device=device)[:, None]
        key = torch.arange(*cols, device=device)[None, :]
        ends = torch.tensor([s.end for s in self.segments], device=device)
        segment = torch.searchsorted(ends, query, right=True)  # the segment of each query
        causal = torch.tensor([s.causal for s in self.segments], device=device)[segment.clamp(max=len(ends) - 1)]
        limit = torch.where(causal, query + 1, ends[segment.clamp(max=len(ends) - 1)])
        keep = (key < limit)[None, None]
        if self.key_valid is not None:
            keep = keep & self.key_valid[:, None, None, cols[0]:cols[1]].to(device)
        return None if bool(keep.all()) else keep

    def attend(self, query, key, value, scale):
        """One SDPA per segment, as ComfyUI computes it (image segments unmasked unless keys are invalid)."""
        outs = []
        for segment in self.segments:
            mask = None
            if segment.causal:
                count = segment.end - segment.start
                mask = torch.ones(count, segment.end, dtype=torch.bool, device=query.device).tril(segment.start)
            if self.key_valid is not None:
                valid = self.key_valid[:, None, None, :segment.end]
                mask = valid if mask is None else mask & valid
            outs.append(F.scaled_dot_product_attention(query[:, :, segment.start:segment.end],
                                                       key[:, :, :segment.end], value[:, :, :segment.end],
                                                       attn_mask=mask, scale=scale))
        return torch.cat(outs, dim=2)
