"""FP8 all-to-all (opt-in per model: load option fp8_exchange): a [..., D] buffer quantized to fp8 e4m3 with one
scale per row (per token and head), sent as bytes, dequantized on receipt. Each row travels as D fp8 bytes plus a
4-byte float32 scale (D=128: 132 bytes instead of 256 in bf16). Bytes work on every backend (gloo has no fp8 type).
Ulysses' two exchanges use it; the ring's key/value shifts stay in the compute dtype.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
SCALE_BYTES = 4


def quantize(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> uint8 [..., D + 4]: fp8 e4m3 values of x / scale, then the row's float32 scale (amax / 448)."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().div_(FP8_MAX).clamp_min_(torch.finfo(torch.float32).tiny)
    packed = torch.empty(*x.shape[:-1], x.shape[-1] + SCALE_BYTES, dtype=torch.uint8, device=x.device)
    packed[..., :x.shape[-1]] = (x.float() / scale).to(FP8).view(torch.uint8)
    packed[..., x.shape[-1]:] = scale.view(torch.uint8)
    return packed


def dequantize(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """quantize()'s bytes [..., D + 4] -> [..., D] in dtype."""
    width = packed.shape[-1] - SCALE_BYTES
    values = packed[..., :width].contiguous().view(FP8).float()
    scale = packed[..., width:].contiguous().view(torch.float32)
    return values.mul_(scale).to(dtype)


class AllToAll:
    """One all_to_all_single of a contiguous [P, ..., D] buffer, plain or through fp8 bytes, sync or in flight;
    result() waits and returns the received buffer in the sent shape and dtype."""

    def __init__(self, send: torch.Tensor, group, fp8: bool = False, async_op: bool = False):
        self.dtype, self.fp8 = send.dtype, fp8
        self.sent = quantize(send) if fp8 else send  # kept alive while the exchange is in flight
        self.received = torch.empty_like(self.sent)
        self.work = dist.all_to_all_single(self.received, self.sent, group=group, async_op=async_op)

    def result(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return dequantize(self.received, self.dtype) if self.fp8 else self.received


def exchange_bytes(shape: tuple[int, ...], dtype: torch.dtype, fp8: bool) -> int:
    """Bytes of a [..., D] buffer on the wire, plain or through fp8_all_to_all."""
    rows = 1
    for size in shape[:-1]:
        rows *= size
    if fp8:
        return rows * (shape[-1] + SCALE_BYTES)
    return rows * shape[-1] * torch.empty((), dtype=dtype).element_size()
