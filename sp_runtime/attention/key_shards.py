"""Attention of replicated queries over keys split across the sequence group (e.g. LTX-2's audio attending to the
sharded video): each rank attends to its own key shard, and the partial results merge exactly by log-sum-exp after
an all-gather of the [B, H, Lq] rows over the sequence group (gather_rows). Cheap when the queries are few: nothing
of the keys travels.

Every rank ends with the same output, bit for bit (same gathered parts, merged in rank order), so replicated
states stay replicated. An empty shard adds nothing (its log-sum-exp is -inf).
"""
from __future__ import annotations

import torch

from ..groups import SeqParallel
from .gather import gather_rows
from .lse import attention_with_lse


def attention_over_key_shards(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              seq: SeqParallel) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v of queries [B, Lq, H, D] (the same on every rank) over the keys / values
    [B, n, H, D] that all ranks of `seq` hold together (n may be 0 on some ranks). Returns [B, Lq, H, D]."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if k.shape[2] > 0:
        out, lse = attention_with_lse(q, k, v)
        out = out.float()
    else:
        out = q.new_zeros(q.shape, dtype=torch.float32)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    if seq.degree > 1:
        out, lse = _merge(_gathered(out, seq), _gathered(lse, seq))
    return out.to(query.dtype).transpose(1, 2)


def _gathered(tensor: torch.Tensor, seq: SeqParallel) -> torch.Tensor:
    """Every sequence rank's part, stacked in rank order: [degree, *tensor.shape]."""
    return gather_rows(tensor, seq).view(seq.degree, *tensor.shape)


def _merge(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial outputs [P, B, H, L, D] with their log-sum-exps [P, B, H, L] -> the attention over all keys."""
    total = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - total).nan_to_num_(0.0)  # parts without keys: -inf - (-inf)
    return (outs * weights.unsqueeze(-1)).sum(dim=0), total

