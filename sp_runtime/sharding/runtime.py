"""Sharded blocks at run time: a block's tensors are views of its gathered buffer while it runs and empty
placeholders otherwise; forward hooks gather each block before it runs, prefetch the next one and free it after."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from .layout import BlockLayout, block_layout, block_slots, find_blocks, pack

SHARDS_ATTRIBUTE = "sp_weight_shards"  # set on a diffusers model whose blocks are sharded: its WeightShards


class ShardedBlock:
    """One block: this rank's slice of its flat buffer, and the owners of its slots."""

    def __init__(self, block: torch.nn.Module, layout: BlockLayout, shard: torch.Tensor, rank: int):
        self.block, self.layout, self.shard, self.rank = block, layout, shard, rank
        self.owners = [block.get_submodule(slot.module) for slot in layout.slots]
        for slot, owner in zip(layout.slots, self.owners):  # fresh placeholders: the loaded tensors are dropped
            empty = torch.empty(0, dtype=slot.dtype, device=shard.device)
            if slot.kind == "parameter":
                owner._parameters[slot.name] = torch.nn.Parameter(empty, requires_grad=False)
            else:
                owner._buffers[slot.name] = empty

    def install(self, buffer: torch.Tensor) -> None:
        """Make the block's tensors views of the gathered buffer."""
        for slot, owner in zip(self.layout.slots, self.owners):
            self._set(owner, slot, self.layout.view(buffer, slot))

    def release(self) -> None:
        for slot, owner in zip(self.layout.slots, self.owners):
            self._set(owner, slot, torch.empty(0, dtype=slot.dtype, device=self.shard.device))

    @staticmethod
    def _set(owner: torch.nn.Module, slot, tensor: torch.Tensor) -> None:
        if slot.kind == "parameter":
            owner._parameters[slot.name].data = tensor
        else:
            owner._buffers[slot.name] = tensor

    def write(self, slot_index: int, value: torch.Tensor) -> None:
        """Store a new value of one slot (e.g. a LoRA-patched weight): this rank keeps only its bytes of it."""
        self.layout.write(self.shard, self.layout.slots[slot_index], self.rank, value)


class WeightShards:
    """The sharded blocks of one model on one rank, with the hooks that gather them around each block's forward.

    Prefetch: when block i starts, the gather of the block that followed i last time (list order at first) is
    issued asynchronously, so at most two blocks are whole at once. The call order is learned, so blocks called out
    of list order (Wan VACE's hint blocks) are prefetched right from the second call. Every rank runs the same
    blocks in the same order, so the collectives match.
    """

    def __init__(self, blocks: list[ShardedBlock]):
        self.blocks = blocks
        self.successor = {index: index + 1 for index in range(len(blocks) - 1)}
        self.first = 0
        self.previous: Optional[int] = None
        self.pending: dict[int, tuple[Any, torch.Tensor]] = {}
        self.live: dict[int, torch.Tensor] = {}
        self.gathered_bytes = 0
        self.gathered_peak = 0
        self.bytes_moved = 0  # gathered bytes received from other ranks, since load
        self.names: dict[str, tuple[ShardedBlock, int]] = {}  # model tensor name -> (block, slot index)
        self.handles = [hook for index, sharded in enumerate(blocks) for hook in (
            sharded.block.register_forward_pre_hook(self._pre_hook(index)),
            sharded.block.register_forward_hook(self._post_hook(index)))]

    @property
    def resident_bytes(self) -> int:
        return sum(block.shard.numel() for block in self.blocks)

    @property
    def full_bytes(self) -> int:
        return sum(block.layout.total for block in self.blocks)

    # ---- one call ------------------------------------------------------------------------------------------------
    def begin(self) -> None:
        """Start gathering the first block while the call embeds its inputs."""
        if self.blocks and self.first not in self.pending:
            self._issue(self.first)

    def finish(self) -> None:
        """Free everything gathered (also after a failed or cancelled call)."""
        for index in list(self.pending):
            self._drop_pending(index)
        for index in list(self.live):
            self.blocks[index].release()
            self._forget(self.live.pop(index))
        self.previous = None

    # ---- hooks ---------------------------------------------------------------------------------------------------
    def _pre_hook(self, index: int):
        def before(module, args):
            self._before(index)
        return before

    def _post_hook(self, index: int):
        def after(module, args, output):
            self.blocks[index].release()
            self._forget(self.live.pop(index))
            self.previous = index
        return after

    def _before(self, index: int) -> None:
        if self.previous is None:
            self.first = index
        else:
            self.successor[self.previous] = index
        for other in [other for other in self.pending if other != index]:  # a wrong guess: wait for it, free it
            self._drop_pending(other)
        if index not in self.pending:
            self._issue(index)
        work, buffer = self.pending.pop(index)
        work.wait()
        self.blocks[index].install(buffer)
        self.live[index] = buffer
        following = self.successor.get(index)
        if following is not None and following != index and following not in self.pending:
            self._issue(following)

    def _issue(self, index: int) -> None:
        sharded = self.blocks[index]
        buffer = torch.empty(sharded.layout.total, dtype=torch.uint8, device=sharded.shard.device)
        # the default group spans every rank of the pool (NCCL on GPUs, gloo on CPUs)
        work = dist.all_gather_into_tensor(buffer, sharded.shard, async_op=True)
        self.pending[index] = (work, buffer)
        self.gathered_bytes += buffer.numel()
        self.gathered_peak = max(self.gathered_peak, self.gathered_bytes)
        self.bytes_moved += buffer.numel() - sharded.shard.numel()

    def _drop_pending(self, index: int) -> None:
        work, buffer = self.pending.pop(index)
        work.wait()
        self._forget(buffer)

    def _forget(self, buffer: torch.Tensor) -> None:
        self.gathered_bytes -= buffer.numel()

    def locate(self, name: str) -> Optional[tuple[ShardedBlock, int]]:
        """(block, slot index) of a model tensor name such as 'transformer_blocks.3.attn.to_q.weight'."""
        return self.names.get(name)

    def meta_tensors(self) -> dict[str, torch.Tensor]:
        """Every sharded tensor by model name, as a meta tensor of its real shape and dtype (the module holds an
        empty placeholder between calls)."""
        return {name: torch.empty(block.layout.slots[index].shape, dtype=block.layout.slots[index].dtype,
                                  device="meta") for name, (block, index) in self.names.items()}

    def name_blocks(self, names: list[str]) -> None:
        """Record each block's name in the model (find_blocks order), for locate()."""
        for block_name, sharded in zip(names, self.blocks):
            for position, slot in enumerate(sharded.layout.slots):
                stem = f"{block_name}.{slot.module}." if slot.module else f"{block_name}."
                self.names[stem + slot.name] = (sharded, position)

    @property
    def largest_block(self) -> int:
        return max((block.layout.total for block in self.blocks), default=0)


def attach(model: torch.nn.Module, blocks: list[ShardedBlock], names: list[str]) -> WeightShards:
    """The model's WeightShards over its sharded blocks (named as in the model), kept on the model."""
    shards = WeightShards(blocks)
    shards.name_blocks(names)
    setattr(model, SHARDS_ATTRIBUTE, shards)
    return shards


def shard_model(model: torch.nn.Module, rank: int, world: int) -> WeightShards:
    """Shard the blocks of a model that holds its whole weights (one block at a time, so memory only drops)."""
    named = find_blocks(model)
    if not named:
        raise ValueError(f"{type(model).__name__} has no transformer blocks (top-level ModuleLists) to shard; load "
                         f"it without shard_weights")
    sharded = []
    for _, block in named:
        entries = block_slots(block)
        layout = block_layout([(m, n, k, t.shape, t.dtype) for m, n, k, t in entries], world)
        device = entries[0][3].device if entries else torch.device("cpu")
        lo, hi = layout.shard_range(rank)
        shard = pack(layout, [t for *_, t in entries], device)[lo:hi].clone()
        sharded.append(ShardedBlock(block, layout, shard, rank))
    return attach(model, sharded, [name for name, _ in named])


def model_shards(model: Any) -> Optional[WeightShards]:
    return getattr(model, SHARDS_ATTRIBUTE, None)


class ShardedWorkerModel:
    """A WorkerModel whose blocks are sharded: every call starts the first gather and frees what is left after."""

    def __init__(self, inner, shards: WeightShards):
        self.inner, self.shards = inner, shards

    def forward(self, x, timestep, inputs: dict[str, Any], out, ctx) -> None:
        self.shards.begin()
        try:
            self.inner.forward(x, timestep, inputs, out, ctx)
        finally:
            self.shards.finish()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def shard_worker(worker, rank: int, world: int):
    """The family's WorkerModel with its blocks sharded over `world` ranks (already sharded while loading, or now)."""
    module = getattr(worker, "model", None)
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"shard_weights is not supported for {worker.info.family!r} models (they are not diffusers "
                         f"modules with transformer blocks)")
    shards = model_shards(module) or shard_model(module, rank, world)
    return ShardedWorkerModel(worker, shards)
