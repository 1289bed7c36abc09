"""sp_attention's extension point: masks over the global sequence and extra keys / values from another branch.

A mask says which keys each query sees by global token positions, so every layout applies it exactly (one device
and Ulysses on the whole sequence, Ring and the hybrid per query block x key block). SegmentMask is Qwen-Image 2.1's
block-causal mask, FunctionMask any rule of positions. KeyValues are keys / values split like a stream of their own
that every query also attends to (e.g. Wan Animate 2's pose keys), after the sequence's own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
import torch.nn.functional as F

from .backends import attend


class SequenceMask(Protocol):
    """Which keys each query sees; positions are global (the whole split sequence, in rank order)."""

    def block(self, rows: tuple[int, int], cols: tuple[int, int], device: torch.device) -> Optional[torch.Tensor]:
        """bool [B or 1, 1, rows, cols] (True = attend) for queries rows[0]..rows[1]-1 and keys cols[0]..cols[1]-1,
        or None when every query sees every key there."""

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scale: Optional[float]) -> torch.Tensor:
        """Masked attention of the whole sequence [B, h, S, D] (where one rank holds it all: one device, Ulysses).
        A mask with `with_extra = True` also gets any extra keys / values, after the sequence's (key [B, h, S + E,
        D]); otherwise those are attended under block()."""


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
    """Attention of a whole sequence [B, h, S, D] over its keys, plus any extra keys after them, under `mask`."""
    if mask is None:
        return attend(query, key, value, None, scale)
    if key.shape[2] == query.shape[2] or getattr(mask, "with_extra", False):
        return mask.attend(query, key, value, scale)
    return attend(query, key, value, mask.block((0, query.shape[2]), (0, key.shape[2]), query.device), scale)


def dense_attend(mask: SequenceMask, query, key, value, scale):
    """SequenceMask.attend for masks without a faster way: one SDPA under the whole [S, S] mask."""
    total = query.shape[2]
    return attend(query, key, value, mask.block((0, total), (0, total), query.device), scale)


@dataclass
class FunctionMask:
    """A mask given as a function of global positions: visible(query [nq, 1], key [1, nk]) -> bool, broadcastable
    to [B or 1, 1, nq, nk] (e.g. a sliding window: (query - key).abs() <= w)."""

    visible: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def block(self, rows, cols, device):
        keep = self.visible(torch.arange(*rows, device=device)[:, None], torch.arange(*cols, device=device)[None, :])
        keep = keep.reshape((1,) * (4 - keep.dim()) + tuple(keep.shape))
        return None if bool(keep.all()) else keep

    def attend(self, query, key, value, scale):
        return dense_attend(self, query, key, value, scale)


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
