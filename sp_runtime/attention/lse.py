"""Attention that also returns the log-sum-exp of each query row, and the exact merge of partial results by it.

Ring attention computes a query block against one key block at a time; two partial outputs over disjoint key sets
combine exactly as out = (exp(lse_a) out_a + exp(lse_b) out_b) / (exp(lse_a) + exp(lse_b)). SDPA does not expose
the LSE, so this module calls the ATen kernels that do: the CPU flash kernel, and on CUDA flash (no mask, half
precision) or memory-efficient (masks, fp32), with a plain-matmul fallback wherever none applies.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .backends import backend_with_lse

_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)  # torch >= 2.3
_CUDA_FAILED: set[tuple] = set()  # CUDA kernel choices that raised once (arch / dtype / shape): not tried again
_BIAS_ALIGNMENT = 16  # the memory-efficient kernel wants the bias rows 16-element aligned (as F.sdpa pads them)


def key_padding_bias(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool key mask [B, Lk] (True = attend) -> additive bias [B, 1, 1, Lk] (0 or -inf) in the query dtype.

    The LSE kernels take float biases only (the CPU flash kernel insists on the query dtype).
    """
    bias = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
    return bias.masked_fill_(~keep.bool(), float("-inf"))[:, None, None, :]


def attention_with_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       bias: Optional[torch.Tensor] = None,
                       scale: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale + bias) v and its row log-sum-exp, for [B, H, L, D] tensors (any strides, last dim 1).

    Returns (out [B, H, Lq, D] in the query dtype, lse [B, H, Lq] float32). Lq and Lk must be > 0 (the CPU flash
    kernel crashes the process on empty inputs). bias: None or an additive float bias broadcastable to
    [B, H, Lq, Lk], e.g. key_padding_bias(). Every query row must have at least one key with a finite bias.
    """
    if query.shape[2] == 0 or key.shape[2] == 0:
        raise ValueError(f"attention_with_lse needs queries and keys, got {query.shape[2]} queries and "
                         f"{key.shape[2]} keys")
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    result = backend_with_lse(query, key, value, bias, scale)  # flash-attn, when selected and it applies
    if result is not None:
        return result
    if query.device.type == "cpu" and _CPU_FLASH is not None:
        out, lse = _CPU_FLASH(query, key, value, attn_mask=None if bias is None else bias.to(query.dtype),
                              scale=scale)
        return out, lse
    if query.device.type == "cuda":
        result = _cuda_with_lse(query, key, value, bias, scale)
        if result is not None:
            return result
    return math_attention_with_lse(query, key, value, bias, scale)


def masked_attention_with_lse(query, key, value, keep: Optional[torch.Tensor], scale=None):
    """attention_with_lse under a mask broadcastable to [B or 1, 1, Lq, Lk]: bool (True = attend), an additive float
    bias (-inf = masked), or None (all keys). A query row that sees no key of this block gets out 0 and lse -inf,
    which LseMerger adds as nothing."""
    if keep is None:
        return attention_with_lse(query, key, value, None, scale)
    if keep.dtype == torch.bool:
        dead = ~keep.any(dim=-1, keepdim=True)  # rows without a visible key: attended unmasked, then dropped
        bias = torch.zeros(keep.shape, dtype=query.dtype, device=query.device)
        bias.masked_fill_(~(keep | dead), float("-inf"))
    else:
        bias = keep.to(device=query.device, dtype=query.dtype)
        dead = torch.isneginf(bias).all(dim=-1, keepdim=True)
        if bool(dead.any()):
            bias = bias.masked_fill(dead, 0.0)
    out, lse = attention_with_lse(query, key, value, bias, scale)
    if bool(dead.any()):
        out = out.masked_fill(dead, 0.0)
        lse = lse.masked_fill(dead[..., 0], float("-inf"))
    return out, lse


def _cuda_with_lse(query, key, value, bias, scale):
    """Flash (no bias, fp16/bf16, head size <= 256 and a multiple of 8) or memory-efficient; None if neither runs."""
    head_dim = query.shape[-1]
    flash_ok = bias is None and query.dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 \
        and head_dim <= 256
    choices = [("flash", _cuda_flash)] if flash_ok else []
    for name, kernel in choices + [("efficient", _cuda_efficient)]:
        choice = (name, query.device.index, query.dtype, head_dim, bias is None)
        if choice in _CUDA_FAILED:
            continue
        try:
            return kernel(query, key, value, bias, scale)
        except torch.OutOfMemoryError:
            raise  # not a kernel limitation: the fallback would need more memory still
        except RuntimeError:  # not built for this GPU / dtype / shape: remember, use the next one
            _CUDA_FAILED.add(choice)
    return None


def _cuda_flash(query, key, value, bias, scale):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, False, False,
                                                                      scale=scale)
    return out, lse


def _cuda_efficient(query, key, value, bias, scale):
    if bias is not None:
        bias = _aligned_bias(bias.to(query.dtype), query, key)
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, bias, True, 0.0,
                                                                          False, scale=scale)
    return out, lse[:, :, :query.shape[2]]  # the kernel pads the LSE rows to a multiple of 32


def _aligned_bias(bias: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Expand to [B, H, Lq, Lk] over a row-aligned buffer, as F.scaled_dot_product_attention prepares it."""
    keys = key.shape[2]
    padded = -(-keys // _BIAS_ALIGNMENT) * _BIAS_ALIGNMENT
    if padded != keys or bias.stride(-1) != 1:
        storage = bias.new_zeros(*bias.shape[:-1], padded)
        storage[..., :keys] = bias
        bias = storage[..., :keys]
    return bias.expand(query.shape[0], query.shape[1], query.shape[2], keys)


def math_attention_with_lse(query, key, value, bias=None, scale=None):
    """Reference formula in float32 (memory O(Lq x Lk) per head): the fallback where no fused kernel applies."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)).mul_(scale)
    if bias is not None:
        scores = scores + bias.float()
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores.sub_(lse.unsqueeze(-1)))
    return torch.matmul(weights, value.float()).to(query.dtype), lse


class LseMerger:
    """Accumulates partial attention results over disjoint key blocks (online softmax), in float32."""

    def __init__(self) -> None:
        self.out: Optional[torch.Tensor] = None
        self.lse: Optional[torch.Tensor] = None

    def add(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        if self.out is None:
            self.out, self.lse = out.float(), lse.float()
            return
        merged = torch.logaddexp(self.lse, lse)
        self.out.mul_(torch.exp(self.lse - merged).nan_to_num_(0.0).unsqueeze(-1))  # rows without keys so far
        self.out.addcmul_(out, torch.exp(lse - merged).nan_to_num_(0.0).unsqueeze(-1))
        self.lse = merged
