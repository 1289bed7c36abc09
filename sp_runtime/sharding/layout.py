"""Which tensors of a model are sharded (every parameter and quantized weight part of each transformer block) and
where each sits in its block's flat byte buffer, the unit that is split across ranks and all-gathered."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch

from ..formats import QuantLinear

ALIGN = 64  # every tensor starts at a multiple of 64 bytes: a view of the uint8 buffer can take any dtype
QUANT_PREFIX = "quant_"  # QuantLinear's buffers holding a quantized weight's parts


def find_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, block) of every entry of the model's top-level ModuleLists (transformer_blocks,
    single_transformer_blocks, blocks, vace_blocks, ...): generic over diffusers' transformer classes."""
    return [(f"{list_name}.{index}", block) for list_name, child in model.named_children()
            if isinstance(child, torch.nn.ModuleList) for index, block in enumerate(child)]


@dataclass(frozen=True)
class Slot:
    """One sharded tensor: `module` (its owner, relative to the block; "" the block) . `name`, stored as `dtype`."""

    module: str
    name: str
    kind: str          # "parameter" or "buffer"
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int        # bytes into the block's flat buffer

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class BlockLayout:
    """A block's slots, and its flat buffer's size: padded so that every rank holds the same number of bytes."""

    slots: tuple[Slot, ...]
    total: int
    world: int

    @property
    def shard_bytes(self) -> int:
        return self.total // self.world

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_bytes, (rank + 1) * self.shard_bytes

    def view(self, buffer: torch.Tensor, slot: Slot) -> torch.Tensor:
        """The tensor of `slot` inside a gathered (full) buffer, without a copy."""
        return buffer[slot.offset: slot.offset + slot.nbytes].view(slot.dtype).reshape(slot.shape)

    def overlap(self, slot: Slot, rank: int) -> Optional[tuple[int, int, int]]:
        """(first byte of the slot that `rank` holds, how many bytes, where they sit in its shard), or None."""
        lo, hi = self.shard_range(rank)
        start, stop = max(lo, slot.offset), min(hi, slot.offset + slot.nbytes)
        return (start - slot.offset, stop - start, start - lo) if start < stop else None

    def write(self, shard: torch.Tensor, slot: Slot, rank: int, value: torch.Tensor) -> None:
        """Copy `rank`'s bytes of a slot's whole value (cast to the slot's dtype) into its shard."""
        overlap = self.overlap(slot, rank)
        if overlap is not None:
            first, count, at = overlap
            data = value.detach().to(slot.dtype).contiguous().reshape(-1).view(torch.uint8)
            shard[at: at + count].copy_(data[first: first + count])


def block_slots(block: torch.nn.Module) -> list[tuple[str, str, str, torch.Tensor]]:
    """(module, name, kind, tensor) of what a loaded block shards, in a fixed order (the same on every rank)."""
    found = []
    for module_name, module in block.named_modules():
        for name, parameter in module.named_parameters(recurse=False):
            found.append((module_name, name, "parameter", parameter.detach()))
        if isinstance(module, QuantLinear):
            found += [(module_name, name, "buffer", buffer) for name, buffer in module.named_buffers(recurse=False)
                      if name.startswith(QUANT_PREFIX)]
    return sorted(found, key=lambda entry: (entry[0], entry[1]))


def block_layout(entries: Iterable[tuple[str, str, str, Sequence[int], torch.dtype]], world: int) -> BlockLayout:
    """The layout of a block's (module, name, kind, shape, dtype) entries, in the order given."""
    slots, offset = [], 0
    for module, name, kind, shape, dtype in entries:
        slot = Slot(module, name, kind, tuple(shape), dtype, offset)
        slots.append(slot)
        offset += -(-slot.nbytes // ALIGN) * ALIGN
    unit = ALIGN * world
    return BlockLayout(tuple(slots), max(unit, -(-offset // unit) * unit), world)


def pack(layout: BlockLayout, tensors: Sequence[torch.Tensor], device) -> torch.Tensor:
    """The block's full flat buffer (uint8) holding `tensors` (in slot order) at their offsets."""
    buffer = torch.zeros(layout.total, dtype=torch.uint8, device=device)
    for slot, tensor in zip(layout.slots, tensors):
        if slot.nbytes:
            layout.view(buffer, slot).copy_(tensor)
    return buffer
