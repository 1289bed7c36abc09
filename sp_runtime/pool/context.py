"""The worker side of one call: the CallContext a family gets (device copies of inputs cached by content version,
and the collective cancel vote between blocks).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..contract import Cancelled
from ..groups import ParallelGroups
from .control import ControlBlock


def view_key(tensor: torch.Tensor) -> tuple:
    """Identifies one exact shared-memory input view (a slice of it has another key)."""
    return tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype


class DeviceCache:
    """Device copies of inputs, keyed by (content version, dtype); kept while the host keeps that content."""

    def __init__(self):
        self._copies: dict[tuple[int, Optional[torch.dtype]], torch.Tensor] = {}

    def keep_only(self, live_versions: set[int]) -> None:
        for key in [key for key in self._copies if key[0] not in live_versions]:
            del self._copies[key]

    def get(self, version: int, dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
        return self._copies.get((version, dtype))

    def put(self, version: int, dtype: Optional[torch.dtype], tensor: torch.Tensor) -> None:
        self._copies[(version, dtype)] = tensor

    def clear(self) -> None:
        self._copies.clear()

    def __len__(self) -> int:
        return len(self._copies)


class WorkerCallContext:
    """CallContext (see sp_runtime.contract) for one call in one worker."""

    def __init__(self, device: torch.device, groups: ParallelGroups, control: ControlBlock,
                 cache: DeviceCache, versions: dict[tuple, int]):
        self.device = device
        self.groups = groups
        self._control = control
        self._cache = cache
        self._versions = versions  # view_key() of a shared-memory input -> its content version
        self.cancel_checks = 0

    def to_device(self, name: str, tensor: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The input on this worker's device (and dtype); an unchanged input reuses the copy made before.

        On a CPU worker with no dtype change this is the shared-memory view itself: valid during this call only.
        """
        target_dtype = dtype if dtype is not None and dtype != tensor.dtype else None
        if self.device.type == "cpu" and target_dtype is None:
            return tensor
        version = self._versions.get(view_key(tensor)) if tensor.numel() else None
        if version is not None:
            cached = self._cache.get(version, target_dtype)
            if cached is not None and cached.shape == tensor.shape:
                return cached
        moved = tensor.to(self.device, dtype=target_dtype or tensor.dtype, non_blocking=False)
        if moved.data_ptr() == tensor.data_ptr():  # nothing was copied: never cache a shared-memory view
            return moved
        if version is not None:
            self._cache.put(version, target_dtype, moved)
        return moved

    def check_cancel(self) -> None:
        """Every rank votes (all_reduce MAX over the gloo control group) so all stop at the same block."""
        self.cancel_checks += 1
        self._control.bump(self.groups.rank)
        flag = int(self._control.cancel_requested())
        group = self.groups.control_group
        if group is not None:
            vote = torch.tensor([flag], dtype=torch.int32)
            dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=group)
            flag = int(vote.item())
        if flag:
            raise Cancelled(f"cancelled by the caller at block check {self.cancel_checks}")
