"""All-gather over the sequence group (its Ulysses group, then its Ring group), for the few per-call values that
the ranks compute in shares and then all need: Wan Animate's motion vectors, attention_over_key_shards' partial
results, a split stream's tokens where a block needs the whole sequence (SeedVR2's windows, Chroma Radiance's
head)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..groups import SeqParallel

# torch >= 2.13 renamed all_gather_into_tensor (and warns about the old name)
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_rows(rows: torch.Tensor, seq: SeqParallel) -> torch.Tensor:
    """Every sequence rank's rows [n, ...] (the same n on every rank) -> [degree * n, ...] in seq.rank order:
    gathered over the Ulysses group first, then over the Ring group (rank = ring rank x U + Ulysses rank)."""
    for group, degree in ((seq.ulysses_group, seq.ulysses_degree), (seq.ring_group, seq.ring_degree)):
        if degree > 1:
            gathered = rows.new_empty(degree * rows.shape[0], *rows.shape[1:])
            all_gather_into(gathered, rows.contiguous(), group=group)
            rows = gathered
    return rows


def gather_tokens(tokens: torch.Tensor, shards, seq: SeqParallel) -> torch.Tensor:
    """Every sequence rank's tokens [B, n_r, ...] of a split stream (its SeqShards) -> [B, N, ...] in stream order:
    shards padded to the largest for the all-gather, then trimmed."""
    if shards is None or shards.degree == 1:
        return tokens
    rows = tokens.transpose(0, 1)
    if rows.shape[0] < shards.chunk:
        rows = torch.cat([rows, rows.new_zeros(shards.chunk - rows.shape[0], *rows.shape[1:])])
    gathered = gather_rows(rows.contiguous(), seq)
    pieces = [gathered[rank * shards.chunk:rank * shards.chunk + size] for rank, size in enumerate(shards.sizes)]
    return torch.cat(pieces).transpose(0, 1)
