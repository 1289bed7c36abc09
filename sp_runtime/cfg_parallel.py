"""CFG-parallel: a call whose batch holds cond and uncond runs each half on its own sequence group.

The pool worker calls run_forward() where it would call model.forward(); families stay unaware of CFG. With
cfg_degree 2 and an even batch, CFG group c (groups.cfg_rank) gets batch rows [c*B/2, (c+1)*B/2) of x, of the
timestep and of every input whose dim 0 is B, and writes that half of the shared-memory output, so the host sees
the whole result. Splitting any even batch this way is exact: a DiT treats every batch row on its own. A batch of 1
(or any odd batch: Flux dev's guidance-distilled calls, a sampler without CFG) runs on all ranks at once through
groups.seq_all (the CFG halves joined as more ring blocks), so no rank idles.

The family sees a layout without CFG: ctx.groups is the layout of the ranks that share its work (config with
cfg_degree 1, rank = position in that sequence group, seq = that group), so a family never splits a batch itself.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from .config import SPConfig
from .contract import CallContext, WorkerModel
from .groups import ParallelGroups, SeqParallel


def run_forward(model: WorkerModel, x: torch.Tensor, timestep: torch.Tensor, inputs: dict[str, Any],
                out: torch.Tensor, ctx: CallContext) -> None:
    """model.forward(x, timestep, inputs, out, ctx), split over the CFG groups when the layout has them."""
    groups = ctx.groups
    if groups.cfg_degree == 1:
        model.forward(x, timestep, inputs, out, ctx)
        return
    batch, config = x.shape[0], groups.config
    if batch % groups.cfg_degree:
        all_ranks = family_groups(groups, groups.seq_all, config.devices)
        model.forward(x, timestep, inputs, out, GroupsView(ctx, all_ranks))
        return
    half = BatchHalf(batch, groups.cfg_rank, groups.cfg_degree)
    first = groups.cfg_rank * config.cfg_group_size
    my_half = family_groups(groups, groups.seq, config.devices[first:first + config.cfg_group_size])
    model.forward(half.take(x), half.take(timestep), half.take(inputs), half.take(out),
                  GroupsView(ctx, my_half, half))


def family_groups(groups: ParallelGroups, seq: SeqParallel, devices) -> ParallelGroups:
    """The layout of the ranks (on `devices`) that share `seq`, as the family sees it: no CFG axis left."""
    tp = groups.tp.degree
    layout = SPConfig(devices=devices, ulysses_degree=seq.ulysses_degree, ring_degree=seq.ring_degree,
                      tensor_parallel_degree=tp)
    return dataclasses.replace(groups, config=layout, rank=seq.rank * tp + groups.tp.rank, seq=seq, cfg_group=None,
                               cfg_rank=0, seq_all=seq)


class BatchHalf:
    """Cuts this CFG group's rows out of every tensor whose dim 0 is the call's batch, remembering the originals."""

    def __init__(self, batch: int, index: int, parts: int):
        size = batch // parts
        self.batch = batch
        self.rows = slice(index * size, (index + 1) * size)
        self.sources: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(half) -> (half, whole)

    def take(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if value.dim() == 0 or value.shape[0] != self.batch:
                return value  # shared by the whole batch (a scalar, a [1, ...] broadcast)
            half = value[self.rows]
            self.sources[id(half)] = (half, value)
            return half
        if isinstance(value, (list, tuple)):
            return type(value)(self.take(item) for item in value)
        if isinstance(value, dict):
            return {key: self.take(item) for key, item in value.items()}
        return value

    def whole_of(self, tensor: torch.Tensor) -> Optional[torch.Tensor]:
        source = self.sources.get(id(tensor))
        return source[1] if source is not None and source[0] is tensor else None


class GroupsView:
    """The pool's CallContext, presenting other groups (the CFG half's or all ranks') to the family.

    to_device of a batch half moves the whole input through the pool's context (which keeps device copies of
    unchanged inputs, such as the text embeddings, across steps) and cuts the half on the device.
    """

    def __init__(self, ctx: CallContext, groups: ParallelGroups, half: Optional[BatchHalf] = None):
        self._ctx = ctx
        self.groups = groups
        self._half = half

    @property
    def device(self) -> torch.device:
        return self._ctx.device

    def to_device(self, name: str, tensor: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        whole = self._half.whole_of(tensor) if self._half is not None else None
        if whole is None:
            return self._ctx.to_device(name, tensor, dtype)
        return self._ctx.to_device(name, whole, dtype)[self._half.rows]

    def check_cancel(self) -> None:
        self._ctx.check_cancel()

    def __getattr__(self, name: str) -> Any:  # anything else the pool's context offers
        return getattr(self._ctx, name)
