"""Loading a model sharded: checkpoint.load_weights hands each block tensor to a ShardSink, so a worker never holds
more than its shards, the replicated non-block weights and one tensor (one block for quantized files).

Plain float files: each block's layout follows from the empty model (shapes, target dtypes), so every rank knows
its byte range before reading and reads only the rows of each tensor that overlap it (safetensors get_slice: only
those pages of the mapping are touched). Quantized files: the stored parts' sizes are known once read, so each
block's tensors are read whole, packed, and all but this rank's bytes dropped.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from typing import Iterator, Mapping, Optional, Union

import torch

from ..formats import QuantWeight, install_quant_linears
from .layout import QUANT_PREFIX, BlockLayout, block_layout, find_blocks, pack
from .runtime import ShardedBlock, attach


@dataclass(frozen=True)
class ShardSpec:
    """This rank among the `world` ranks that share every block."""

    rank: int
    world: int


# A module global, as attention.options does: a worker loads one model at a time, and the families' loaders need
# not pass the spec down to checkpoint.load_weights.
_current: Optional[ShardSpec] = None


@contextlib.contextmanager
def sharded_loading(spec: Optional[ShardSpec]) -> Iterator[None]:
    """While active, load_weights shards the blocks of the model it loads (spec None: loads whole)."""
    global _current
    previous, _current = _current, spec
    try:
        yield
    finally:
        _current = previous


Value = Union[torch.Tensor, QuantWeight]


class ShardSink:
    """Receives the block tensors of one model while it loads and makes each block a ShardedBlock once complete."""

    def __init__(self, model: torch.nn.Module, spec: ShardSpec, targets: Mapping[str, Optional[torch.dtype]],
                 device: torch.device, plain: bool):
        self.model, self.spec, self.device = model, spec, device
        named = find_blocks(model)
        self.order = [name for name, _ in named]
        self.blocks = dict(named)
        self.expected: dict[str, set[str]] = {name: set() for name in self.order}
        for key in targets:
            block = self.block_of(key)
            if block is not None:
                self.expected[block].add(key[len(block) + 1:])
        self.received: dict[str, dict[str, Optional[Value]]] = {name: {} for name in self.order}
        self.planned: dict[str, tuple[BlockLayout, dict, torch.Tensor]] = {}
        if plain:
            for name in self.order:
                self._plan(name, targets)
        self.done: dict[str, ShardedBlock] = {}
        self.names: set[str] = set()

    @classmethod
    def for_model(cls, model: torch.nn.Module, targets: Mapping[str, Optional[torch.dtype]], device,
                  plain: bool) -> Optional["ShardSink"]:
        """A sink when a sharded load is current and the model has blocks, else None (load whole).
        plain: the file holds no quantized weights (block layouts are known before reading)."""
        if _current is None or _current.world < 2 or not find_blocks(model):
            return None
        return cls(model, _current, targets, torch.device(device), plain)

    def block_of(self, key: str) -> Optional[str]:
        head, _, rest = key.partition(".")
        name = f"{head}.{rest.split('.', 1)[0]}"
        return name if name in self.blocks else None

    # ---- plain files: this rank's bytes only ---------------------------------------------------------------------
    def _plan(self, name: str, targets: Mapping[str, Optional[torch.dtype]]) -> None:
        block, entries = self.blocks[name], []
        for key in sorted(self.expected[name], key=lambda key: tuple(key.rpartition(".")[::2])):
            module, _, attribute = key.rpartition(".")
            owner = block.get_submodule(module)
            tensor = owner._parameters.get(attribute)
            kind = "parameter" if tensor is not None else "buffer"
            tensor = tensor if tensor is not None else owner._buffers.get(attribute)
            dtype = targets[f"{name}.{key}"]
            if dtype is None or tensor is None:
                return  # an integer buffer keeps the file's dtype, unknown here: this block is packed after reading
            entries.append((module, attribute, kind, tuple(tensor.shape), dtype))
        layout = block_layout(entries, self.spec.world)
        slots = {f"{name}.{slot.module}.{slot.name}" if slot.module else f"{name}.{slot.name}": slot
                 for slot in layout.slots}
        self.planned[name] = (layout, slots, torch.zeros(layout.shard_bytes, dtype=torch.uint8, device=self.device))

    def read_slices(self, handle, key: str, outputs) -> Optional[tuple[tuple[int, ...], str]]:
        """Read this rank's rows of the tensor `key` for its block targets `outputs` [(target, transform)]; returns
        the file tensor's shape and safetensors dtype, or None when it is not a tensor of planned blocks (read it
        whole, then put)."""
        blocks = [self.block_of(target) for target, _ in outputs]
        if not hasattr(handle, "get_slice") or any(block not in self.planned for block in blocks):
            return None
        source = handle.get_slice(key)
        shape = tuple(source.get_shape())
        for (target, transform), block in zip(outputs, blocks):
            layout, slots, shard = self.planned[block]
            rows = _source_rows(shape, slots[target].shape, transform)
            if rows is None:  # not a row selection: this rank's bytes of the whole tensor
                whole = handle.get_tensor(key)
                layout.write(shard, slots[target], self.spec.rank, transform(whole) if transform else whole)
            else:
                _write_rows(shard, layout, slots[target], self.spec.rank, source, rows)
            self._received(block, target, None)
        return shape, source.get_dtype()

    # ---- every file: tensors read whole -------------------------------------------------------------------------
    def put(self, block: str, key: str, value: Value) -> None:
        """A block tensor as it will be stored (cast, or a quantized weight)."""
        if block in self.planned:
            layout, slots, shard = self.planned[block]
            layout.write(shard, slots[key], self.spec.rank, value)
            value = None
        self._received(block, key, value)

    def _received(self, block: str, key: str, value: Optional[Value]) -> None:
        self.received[block][key[len(block) + 1:]] = value
        self.names.add(key)
        if self.expected[block] <= set(self.received[block]):
            self._finish_block(block)

    def finish(self) -> None:
        """Attach the model's WeightShards (blocks still incomplete are reported by load_weights' key check)."""
        for block in self.order:
            if block not in self.done and self.expected[block] <= set(self.received[block]):
                self._finish_block(block)
        if len(self.done) == len(self.order):
            attach(self.model, [self.done[name] for name in self.order], self.order)

    def _finish_block(self, name: str) -> None:
        values, self.received[name] = self.received[name], {}
        if name in self.planned:
            layout, _, shard = self.planned.pop(name)
        else:
            layout, shard = self._pack(name, values)
        self.done[name] = ShardedBlock(self.blocks[name], layout, shard, self.spec.rank)

    def _pack(self, name: str, values: dict[str, Value]) -> tuple[BlockLayout, torch.Tensor]:
        block, entries = self.blocks[name], []
        for key, value in values.items():
            module, _, attribute = key.rpartition(".")
            if isinstance(value, QuantWeight):
                entries += [(module, QUANT_PREFIX + part, "buffer", tensor)
                            for part, tensor in {**value.rows, **value.consts}.items()]
                _install_quant_placeholder(block, key, value, values.get(f"{module}.bias"))
            else:
                owner = block.get_submodule(module)
                kind = "parameter" if attribute in owner._parameters else "buffer"
                entries.append((module, attribute, kind, value))
        entries.sort(key=lambda entry: (entry[0], entry[1]))
        layout = block_layout([(m, n, k, t.shape, t.dtype) for m, n, k, t in entries], self.spec.world)
        lo, hi = layout.shard_range(self.spec.rank)
        return layout, pack(layout, [t for *_, t in entries], self.device)[lo:hi].clone()


def _source_rows(shape: tuple, target_shape: tuple, transform) -> Optional[torch.Tensor]:
    """The file tensor's row behind each row of the target (the key plan's transforms select rows: an index column
    through the transform says which), or None when the transform does something else (or the tensor is 0-d)."""
    if not shape or tuple(shape[1:]) != tuple(target_shape[1:]):
        return None
    index = torch.arange(shape[0]).reshape(shape[0], *[1] * (len(shape) - 1))
    try:
        rows = transform(index) if transform is not None else index
    except (RuntimeError, ValueError, IndexError):
        return None
    if rows.shape[0] != target_shape[0] or any(size != 1 for size in rows.shape[1:]):
        return None
    return rows.reshape(-1)


def _write_rows(shard: torch.Tensor, layout: BlockLayout, slot, rank: int, source, rows: torch.Tensor) -> None:
    """Copy this rank's bytes of a slot from the file, reading only the rows that hold them (a run of consecutive
    rows per get_slice; rows out of order are read one run at a time)."""
    overlap = layout.overlap(slot, rank)
    if overlap is None:
        return
    first, count, at = overlap
    row_bytes = math.prod(slot.shape[1:]) * slot.dtype.itemsize
    start, stop = first // row_bytes, -(-(first + count) // row_bytes)
    picked = rows[start:stop].tolist()
    runs, begin = [], 0
    for position in range(1, len(picked) + 1):
        if position == len(picked) or picked[position] != picked[position - 1] + 1:
            runs.append(source[picked[begin]: picked[position - 1] + 1])
            begin = position
    part = runs[0] if len(runs) == 1 else torch.cat(runs)
    data = part.to(slot.dtype).contiguous().reshape(-1).view(torch.uint8)
    skip = first - start * row_bytes
    shard[at: at + count].copy_(data[skip: skip + count])


def _install_quant_placeholder(block: torch.nn.Module, key: str, weight: QuantWeight,
                               bias: Optional[torch.Tensor]) -> None:
    """The block's Linear becomes a QuantLinear whose parts (and bias) are empty until the block is gathered."""
    def empty(tensor):
        return torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    placeholder = replace(weight, rows={k: empty(v) for k, v in weight.rows.items()},
                          consts={k: empty(v) for k, v in weight.consts.items()})
    state = {} if bias is None else {f"{key.rsplit('.', 1)[0]}.bias": empty(bias)}
    install_quant_linears(block, {key: placeholder}, state)
