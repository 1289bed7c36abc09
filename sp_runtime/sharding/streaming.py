"""Loading a model sharded: checkpoint.load_weights hands each block tensor it reads to a ShardSink, which packs a
block as soon as all its tensors are read and keeps only this rank's bytes, so a worker never holds more than its
shards, the replicated non-block weights and one block."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Iterator, Optional, Union

import torch

from ..formats import QuantWeight, install_quant_linears
from .layout import QUANT_PREFIX, block_layout, find_blocks, pack
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
    """Collects the tensors of each block of one model while it loads and shards every completed block."""

    def __init__(self, model: torch.nn.Module, spec: ShardSpec):
        self.model, self.spec = model, spec
        named = find_blocks(model)
        self.order = [name for name, _ in named]
        self.blocks = dict(named)
        self.expected: dict[str, set[str]] = {name: set() for name in self.order}
        for key in model.state_dict(keep_vars=True):
            block = self.block_of(key)
            if block is not None:
                self.expected[block].add(key[len(block) + 1:])
        self.received: dict[str, dict[str, Value]] = {name: {} for name in self.order}
        self.done: dict[str, ShardedBlock] = {}
        self.names: set[str] = set()

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> Optional["ShardSink"]:
        """A sink when a sharded load is current and the model has blocks, else None (load whole)."""
        if _current is None or _current.world < 2 or not find_blocks(model):
            return None
        return cls(model, _current)

    def block_of(self, key: str) -> Optional[str]:
        head, _, rest = key.partition(".")
        name = f"{head}.{rest.split('.', 1)[0]}"
        return name if name in self.blocks else None

    def put(self, block: str, key: str, value: Value) -> None:
        """A block tensor as it will be stored (cast, or a quantized weight); the block is sharded once complete."""
        self.received[block][key[len(block) + 1:]] = value
        self.names.add(key)
        if self.expected[block] <= set(self.received[block]):
            self._shard(block)

    def finish(self) -> None:
        """Attach the model's WeightShards (blocks still incomplete are reported by load_weights' key check)."""
        for block in self.order:
            if block not in self.done and self.expected[block] <= set(self.received[block]):
                self._shard(block)
        if len(self.done) == len(self.order):
            attach(self.model, [self.done[name] for name in self.order], self.order, self.spec.rank,
                   self.spec.world)

    def _shard(self, name: str) -> None:
        block, values = self.blocks[name], self.received.pop(name)
        self.received[name] = {}
        entries = []
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
        device = entries[0][3].device if entries else torch.device("cpu")
        lo, hi = layout.shard_range(self.spec.rank)
        shard = pack(layout, [t for *_, t in entries], device)[lo:hi].clone()
        self.done[name] = ShardedBlock(block, layout, shard, self.spec.rank)


def _install_quant_placeholder(block: torch.nn.Module, key: str, weight: QuantWeight,
                               bias: Optional[torch.Tensor]) -> None:
    """The block's Linear becomes a QuantLinear whose parts (and bias) are empty until the block is gathered."""
    def empty(tensor):
        return torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    placeholder = replace(weight, rows={k: empty(v) for k, v in weight.rows.items()},
                          consts={k: empty(v) for k, v in weight.consts.items()})
    state = {} if bias is None else {f"{key.rsplit('.', 1)[0]}.bias": empty(bias)}
    install_quant_linears(block, {key: placeholder}, state)
