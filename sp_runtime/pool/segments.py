"""Shared-memory segments of a pool: owner-only POSIX segments named usp_<parent pid>_..., mapped as uint8 tensors.

The host creates and unlinks every segment; workers only attach. Names carry the creating process's PID so a
later start can unlink what a killed parent left behind.
"""
from __future__ import annotations

import logging
import os
import re
import sys
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Optional

import numpy as np
import torch

PREFIX = "usp_"
SHM_DIR = "/dev/shm"  # where Linux shows POSIX shared memory; elsewhere stale segments are not listed
_STALE_NAME = re.compile(rf"^{PREFIX}(\d+)_")
log = logging.getLogger("ulysses_sp.pool")

# Mappings that could not be closed yet because tensors still view them; retried by release_retired().
_retired: list[SharedMemory] = []


def owned_name(tag: str) -> str:
    """A segment name owned by this process (stays under macOS's 31-character limit for short tags)."""
    return f"{PREFIX}{os.getpid()}_{tag}"


def _as_tensor(shm: SharedMemory) -> torch.Tensor:
    # Through numpy, so the mapping holds a buffer export while any tensor views it: closing it then raises
    # BufferError instead of leaving tensors pointing at unmapped memory (torch.frombuffer keeps no export).
    return torch.from_numpy(np.frombuffer(shm.buf, dtype=np.uint8))


class Segment:
    """One mapped segment and a uint8 tensor over all of it."""

    def __init__(self, shm: SharedMemory, owner: bool):
        self.shm = shm
        self.owner = owner
        self.base: Optional[torch.Tensor] = _as_tensor(shm)

    @classmethod
    def create(cls, tag: str, size: int) -> "Segment":
        # SharedMemory creates the segment with mode 0600 (owner only).
        return cls(SharedMemory(name=owned_name(tag), create=True, size=max(1, size)), owner=True)

    @classmethod
    def attach(cls, name: str) -> "Segment":
        return cls(_attach_untracked(name), owner=False)

    @property
    def name(self) -> str:
        return self.shm.name

    @property
    def size(self) -> int:
        return self.shm.size

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        nbytes = nbytes_of(dtype, shape)
        if offset + nbytes > self.size:
            raise ValueError(f"a tensor of {nbytes} bytes at offset {offset} does not fit segment {self.name} "
                             f"of {self.size} bytes")
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return self.base[offset:offset + nbytes].view(dtype).view(shape)

    def release(self) -> None:
        """Unmap (once no tensor views it any more) and, for the owner, unlink the name."""
        self.base = None
        if self.owner:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass
        _close_or_retire(self.shm)


def nbytes_of(dtype: torch.dtype, shape) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count * dtype.itemsize


def _attach_untracked(name: str) -> SharedMemory:
    """Attach without registering with a resource tracker, so a worker's exit never unlinks the host's segment."""
    if sys.version_info >= (3, 13):
        return SharedMemory(name=name, track=False)
    # Python < 3.13 registers every attach with the resource tracker (and would start one tracker process per
    # worker). Workers attach from their main thread only, so swapping the function for the call is safe here.
    register = resource_tracker.register
    resource_tracker.register = lambda *args, **kwargs: None
    try:
        return SharedMemory(name=name)
    finally:
        resource_tracker.register = register


def _close_or_retire(shm: SharedMemory) -> None:
    try:
        shm.close()
    except BufferError:
        _retired.append(shm)


def release_retired() -> None:
    """Close mappings whose last views have gone since they were released."""
    for shm in list(_retired):
        try:
            shm.close()
            _retired.remove(shm)
        except BufferError:
            pass


def clean_stale_segments() -> list[str]:
    """Unlink segments of ours whose creating process is gone (a killed parent). Returns the names removed."""
    if not os.path.isdir(SHM_DIR):
        return []
    removed = []
    for name in os.listdir(SHM_DIR):
        match = _STALE_NAME.match(name)
        if not match or pid_alive(int(match.group(1))):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            os.unlink(path)
            removed.append(name)
        except OSError:
            continue
    if removed:
        log.info("removed %d shared-memory segment(s) left by dead processes: %s", len(removed), removed)
    return removed


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def our_segments(pid: Optional[int] = None) -> list[str]:
    """Names of our segments in /dev/shm (of one creating process, or all); used by tests and status."""
    if not os.path.isdir(SHM_DIR):
        return []
    prefix = PREFIX if pid is None else f"{PREFIX}{pid}_"
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix))
