"""LTX-2's guide attention mask (LTXVAddGuide at a strength other than 1 or with an attention_mask): the guide tokens
appended at the end of the video get per-token weights w, and the video's self-attention adds log w to the scores
between the denoised tokens and the guide tokens, both ways (ComfyUI's per-guide self-attention mask, as its LTXV
model builds it). A structured sp_attention mask (attention.SequenceMask): every layout asks it for query tiles,
so it never becomes S x S."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def log_weights(weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-guide-token weights -> the additive bias log w in `dtype`, with the dtype's lowest value for w = 0 (as
    ComfyUI computes it in the model's dtype)."""
    weights = weights.to(dtype)
    lowest = torch.finfo(dtype)
    positive = weights > 0
    logs = torch.full_like(weights, lowest.min)
    logs[positive] = torch.log(weights[positive].clamp(min=lowest.tiny))
    return logs


@dataclass
class GuideMask:
    """Tokens start .. start + len(log_w) - 1 are weighted guide tokens: a query before `start` sees guide key j with
    bias log_w[j], guide query j sees every key before `start` with bias log_w[j]; all other pairs are unbiased
    (tokens after the weighted ones too)."""

    start: int
    log_w: torch.Tensor  # [G] in the attention dtype

    @property
    def cuts(self) -> tuple[int, int]:
        return self.start, self.start + self.log_w.numel()

    def block(self, rows, cols, device) -> Optional[torch.Tensor]:
        lo, hi = self.cuts
        if rows[0] >= hi or (rows[1] <= lo and (cols[1] <= lo or cols[0] >= hi)) or \
                (rows[0] >= lo and cols[0] >= lo):
            return None  # no query-key pair here crosses between the denoised and the weighted guide tokens
        log_w = self.log_w.to(device)
        query, key = torch.arange(*rows, device=device)[:, None], torch.arange(*cols, device=device)[None, :]
        key_bias = torch.where((key >= lo) & (key < hi), log_w[(key - lo).clamp(0, hi - lo - 1)], 0.0)
        if rows[1] <= lo:  # denoised queries only: one row of biases for all of them
            return key_bias[None, None]
        query_bias = torch.where((query >= lo) & (query < hi), log_w[(query - lo).clamp(0, hi - lo - 1)], 0.0)
        bias = torch.where(query < lo, key_bias, 0.0) + torch.where(key < lo, query_bias, 0.0)
        return bias.to(log_w.dtype)[None, None]


def guide_mask(weights: Optional[torch.Tensor], total: int, guides: int, dtype: torch.dtype) -> Optional[GuideMask]:
    """The mask for input guide_weights ([B, W]: one weight per weighted guide token, from the first guide token on,
    the same for every item; the host's pack builds it from LTXVAddGuide's attention entries) on a video of `total`
    tokens whose last `guides` are guide tokens; None without weights or when all are 1."""
    if weights is None:
        return None
    if weights.dim() != 2 or bool((weights != weights[:1]).any()):
        raise ValueError(f"guide_weights has shape {list(weights.shape)}; give [B, W] with the same weights for "
                         f"every batch item")
    weights = weights[0]
    if weights.numel() > guides:
        raise ValueError(f"guide_weights holds {weights.numel()} weights but the video has {guides} guide tokens "
                         f"(keyframe_idxs)")
    if weights.numel() == 0 or bool((weights == 1.0).all()):
        return None
    return GuideMask(total - guides, log_weights(weights, dtype))
