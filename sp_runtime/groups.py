"""Process groups of one worker: the Ulysses, Ring, CFG and tensor-parallel axes of an SPConfig, built after
init_process_group.

Every rank must call build_groups() in the same order (torch.distributed.new_group is collective).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from .config import SPConfig


@dataclass
class SeqParallel:
    """What attention needs to know about the ranks that share one sequence (Ulysses inner, Ring outer)."""

    ulysses_group: Optional[dist.ProcessGroup]
    ulysses_rank: int
    ulysses_degree: int
    ring_group: Optional[dist.ProcessGroup] = None
    ring_rank: int = 0
    ring_degree: int = 1
    ring_global_ranks: tuple[int, ...] = (0,)

    @property
    def degree(self) -> int:
        return self.ulysses_degree * self.ring_degree

    @property
    def rank(self) -> int:
        """Position of this rank's shard in the sequence: ring blocks of Ulysses shards."""
        return self.ring_rank * self.ulysses_degree + self.ulysses_rank

    @classmethod
    def single(cls) -> "SeqParallel":
        """No parallelism: one rank holds the whole sequence."""
        return cls(ulysses_group=None, ulysses_rank=0, ulysses_degree=1)


@dataclass(frozen=True)
class TensorParallel:
    """The ranks that hold one slice each of every split weight (same tokens, heads split between them)."""

    group: Optional[dist.ProcessGroup]
    rank: int
    degree: int

    @classmethod
    def single(cls) -> "TensorParallel":
        return cls(None, 0, 1)


@dataclass
class ParallelGroups:
    """This rank's coordinates and groups on every axis, plus a gloo group over all ranks for host-side votes.

    seq is the sequence group of this rank's CFG half; seq_all spans every rank (same Ulysses groups, the CFG axis
    joined to the Ring axis) for calls that cannot be split by CFG (batch 1); it is seq when cfg_degree is 1.
    """

    config: SPConfig
    rank: int
    seq: SeqParallel
    cfg_group: Optional[dist.ProcessGroup]
    cfg_rank: int
    control_group: Optional[dist.ProcessGroup]
    seq_all: Optional[SeqParallel] = None
    tp: "TensorParallel" = None

    def __post_init__(self) -> None:
        if self.seq_all is None:
            self.seq_all = self.seq
        if self.tp is None:
            self.tp = TensorParallel.single()

    @property
    def cfg_degree(self) -> int:
        return self.config.cfg_degree


def _ranks_along(config: SPConfig, axis: str) -> list[list[int]]:
    """All rank lists that differ only in `axis` ('ulysses', 'ring', 'cfg', 'tp', or 'ring+cfg' for both)."""
    indices = [{"cfg": 0, "ring": 1, "ulysses": 2, "tp": 3}[name] for name in axis.split("+")]
    groups: dict[tuple, list[int]] = {}
    for rank in range(config.world_size):
        coords = [*config.coords(rank), config.tp_index(rank)]
        for index in indices:
            coords[index] = -1
        groups.setdefault(tuple(coords), []).append(rank)
    return list(groups.values())


def _new_groups(config: SPConfig, axis: str, rank: int, backend: Optional[str] = None):
    """Create every group of one axis (collective) and return (this rank's group, its ranks in rank order)."""
    mine = None, [rank]
    for ranks in _ranks_along(config, axis):
        group = dist.new_group(ranks, backend=backend) if len(ranks) > 1 else None
        if rank in ranks:
            mine = group, ranks
    return mine


def build_groups(config: SPConfig) -> ParallelGroups:
    """Build all groups of this layout on the already-initialised default process group."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if dist.is_initialized() and dist.get_world_size() != config.world_size:
        raise ValueError(f"the process group has {dist.get_world_size()} ranks but the layout has "
                         f"{config.world_size} devices")
    cfg_index, ring_index, ulysses_index = config.coords(rank)
    if config.world_size == 1:
        return ParallelGroups(config, 0, SeqParallel.single(), None, 0, None)
    ulysses_group, _ = _new_groups(config, "ulysses", rank)
    ring_group, ring_ranks = _new_groups(config, "ring", rank)
    cfg_group, _ = _new_groups(config, "cfg", rank)
    tp_group, _ = _new_groups(config, "tp", rank)
    control_group = dist.new_group(list(range(config.world_size)), backend="gloo")
    seq = SeqParallel(ulysses_group, ulysses_index, config.ulysses_degree,
                      ring_group, ring_index, config.ring_degree, tuple(ring_ranks))
    tp = TensorParallel(tp_group, config.tp_index(rank), config.tensor_parallel_degree)
    return ParallelGroups(config, rank, seq, cfg_group, cfg_index, control_group, _seq_all(config, rank, seq), tp)


def _seq_all(config: SPConfig, rank: int, seq: SeqParallel) -> SeqParallel:
    """The sequence group over every rank: the CFG halves become more ring blocks (ring index cfg * R + ring).

    Ring rather than a wider Ulysses: it needs no head divisibility, overlaps its transfers, and the CFG axis is
    the outermost (slowest links). Its shard order is the global rank order.
    """
    if config.cfg_degree == 1:
        return seq
    ring_group, ring_ranks = _new_groups(config, "ring+cfg", rank)
    cfg_index, ring_index, _ = config.coords(rank)
    return SeqParallel(seq.ulysses_group, seq.ulysses_rank, seq.ulysses_degree, ring_group,
                       cfg_index * config.ring_degree + ring_index, config.ring_degree * config.cfg_degree,
                       tuple(ring_ranks))
