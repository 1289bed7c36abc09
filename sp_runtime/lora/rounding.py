"""Storing a LoRA-patched float32 weight back in the parameter's dtype.

fp8 storage rounds stochastically, as ComfyUI does (`comfy.float.stochastic_rounding` in
`ModelPatcher.patch_weight_to_device`): a LoRA delta is often smaller than half an fp8 step, and round-to-nearest
would drop it from most weights, while stochastic rounding keeps it in expectation. The random draws are seeded by
the parameter's name, so every rank (and every re-application) stores the same bits. torch has no stochastic
rounding op, hence this small implementation: fp8 magnitudes are ordered like their bit patterns, so the neighbour
on the far side of the value is one bit pattern away from the nearest value.
"""
from __future__ import annotations

import zlib

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
CHUNK_ELEMENTS = 1 << 24  # bounds the temporaries of one rounding step on the device


def store_as(value: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """value (float32) in `dtype`: round to nearest for float dtypes, stochastic (seeded by `name`) for fp8."""
    if dtype not in FP8_DTYPES:
        return value.to(dtype)
    generator = torch.Generator(device=value.device)
    generator.manual_seed(zlib.crc32(name.encode()))
    flat = value.reshape(-1)
    bits = torch.empty(flat.shape, dtype=torch.uint8, device=value.device)
    for start in range(0, flat.numel(), CHUNK_ELEMENTS):
        piece = slice(start, start + CHUNK_ELEMENTS)
        bits[piece] = stochastic_round_fp8(flat[piece], dtype, generator).view(torch.uint8)
    return bits.view(dtype).reshape(value.shape)


def stochastic_round_fp8(value: torch.Tensor, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Each element to one of its two fp8 neighbours, the farther one with probability distance / gap."""
    info = torch.finfo(dtype)
    value = value.float().clamp(info.min, info.max)
    nearest = value.to(dtype)
    near = nearest.float()
    bits = nearest.view(torch.uint8).to(torch.int16)
    sign = torch.where(near == 0, (value < 0).to(torch.int16) * 0x80, bits & 0x80)  # -tiny rounds to +0
    step = torch.where(value.abs() > near.abs(), 1, -1)  # the other neighbour: towards the value
    other_bits = sign | ((bits & 0x7F) + step).clamp(0, 0x7F)
    gap = (other_bits.to(torch.uint8).view(dtype).float() - near).abs()
    chance = torch.where(gap > 0, (value - near).abs() / gap.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    draw = torch.rand(value.shape, generator=generator, device=value.device)
    return torch.where(draw < chance, other_bits, bits).to(torch.uint8).view(dtype)
