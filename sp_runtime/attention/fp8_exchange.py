"""8-bit Ulysses exchange (opt-in per model: load option fp8_exchange; the name is kept from its first, fp8 e4m3,
version): each row of D values (one token and head) travels as uniform integer codes with one bf16 scale, amax / 127
(or / 2047). q, k, v go as 8-bit codes (D + 2 bytes a row), the attention output as 12-bit codes (1.5 D + 2 bytes):
its rounding lands directly in the model's stream, while q / k / v rounding is averaged by the attention.

Why integers: a row's largest values decide the error that matters (max |error|); uniform 8-bit codes err by at most
amax / 254 there, as bf16 does (amax / 256 to amax / 512), where e4m3 errs by amax / 16 to / 32.
benchmarks/bench_fp8_exchange.py measures this and every other encoding tried against bf16. Bytes travel as uint8
(gloo has no fp8 or int8 all-to-all of its own). The ring's key/value shifts stay in the compute dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

SCALE_BYTES = 2  # one bf16 scale per row


@dataclass(frozen=True)
class Codec:
    """Symmetric integer codes of `bits` (8 or 12) per value, one bf16 scale per row of the last dimension."""

    bits: int

    @property
    def top(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def row_bytes(self, dim: int) -> int:
        codes = dim if self.bits == 8 else 3 * -(-dim // 2)  # 12-bit codes go in pairs of 3 bytes
        return codes + SCALE_BYTES

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[..., D] -> uint8 [..., row_bytes(D)]: the codes of x / scale, then the row's bf16 scale."""
        values = x.float()
        # rounded up to bf16 (+2^-7 covers its rounding), so that no code exceeds top; zero rows stay zero
        scale = (values.abs().amax(dim=-1, keepdim=True) * ((1 + 2 ** -7) / self.top)).clamp_min_(1e-38)
        scale = scale.to(torch.bfloat16)
        codes = torch.round(values / scale.float()).clamp_(-self.top, self.top)
        packed = torch.empty(*x.shape[:-1], self.row_bytes(x.shape[-1]), dtype=torch.uint8, device=x.device)
        packed[..., :-SCALE_BYTES] = _pack(codes, self.bits)
        packed[..., -SCALE_BYTES:] = scale.view(torch.uint8)
        return packed

    def decode(self, packed: torch.Tensor, dtype: torch.dtype, dim: Optional[int] = None) -> torch.Tensor:
        """encode()'s bytes -> [..., D] in dtype (D: the row width, needed only for odd widths of 12-bit codes)."""
        if dim is None:
            dim = (packed.shape[-1] - SCALE_BYTES) * 8 // self.bits
        codes = _unpack(packed[..., :-SCALE_BYTES], self.bits, dim)
        scale = packed[..., -SCALE_BYTES:].contiguous().view(torch.bfloat16).float()
        return codes.mul_(scale).to(dtype)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return codes.to(torch.int8).view(torch.uint8)
    unsigned = (codes + 2048).to(torch.int32)  # 12 bits, 1 .. 4095
    if unsigned.shape[-1] % 2:
        unsigned = torch.nn.functional.pad(unsigned, (0, 1), value=2048)
    a, b = unsigned[..., 0::2], unsigned[..., 1::2]
    triple = torch.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], dim=-1)
    return triple.flatten(-2).to(torch.uint8)


def _unpack(data: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    if bits == 8:
        return data.contiguous().view(torch.int8).float()
    triple = data.to(torch.int32).unflatten(-1, (-1, 3))
    a = triple[..., 0] | ((triple[..., 1] & 0xF) << 8)
    b = (triple[..., 1] >> 4) | (triple[..., 2] << 4)
    return (torch.stack([a, b], dim=-1).flatten(-2)[..., :dim] - 2048).float()


INPUT_CODEC = Codec(8)    # q, k, v (to-heads all-to-all)
OUTPUT_CODEC = Codec(12)  # attention output (+ text) back to tokens


class AllToAll:
    """One all_to_all_single of a contiguous [P, ..., D] buffer, plain or through a codec's bytes, sync or in
    flight; result() waits and returns the received buffer in the sent shape and dtype."""

    def __init__(self, send: torch.Tensor, group, codec: Optional[Codec] = None, async_op: bool = False):
        self.dtype, self.codec, self.dim = send.dtype, codec, send.shape[-1]
        self.sent = codec.encode(send) if codec else send  # kept alive while the exchange is in flight
        self.received = torch.empty_like(self.sent)
        self.work = dist.all_to_all_single(self.received, self.sent, group=group, async_op=async_op)

    def result(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.codec.decode(self.received, self.dtype, self.dim) if self.codec else self.received


def exchange_bytes(shape: tuple[int, ...], dtype: torch.dtype, codec: Optional[Codec] = None) -> int:
    """Bytes of a [..., D] buffer on the wire, plain or through a codec."""
    rows = 1
    for size in shape[:-1]:
        rows *= size
    if codec is not None:
        return rows * codec.row_bytes(shape[-1])
    return rows * shape[-1] * torch.empty((), dtype=dtype).element_size()
