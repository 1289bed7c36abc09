"""Shared-memory segments of a pool: owner-only POSIX segments named usp_<pid>_<pool token>_<part><random>, mapped
as uint8 tensors. The random part (fresh per segment) makes the next name unguessable: another local user cannot
pre-create it, and a name taken anyway (FileExistsError) is drawn again.

The host creates and unlinks every segment; workers only attach. Each pool holds an owner file
usp_<pid>_<token>_lock beside its segments (see ownership.py), so a later start, or a worker whose host died, can
unlink what a killed pool left behind, and only that. A segment /dev/shm cannot hold is a file (mappings.py).
"""
from __future__ import annotations

import logging
import os
import re
import secrets
import sys
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Callable, Optional

import numpy as np
import torch

from .mappings import SHM_DIR, FileMapping, Mapping, create_mapping, is_file_mapping
from .ownership import TOKEN_HEX, OwnerLock, owner_is_dead

PREFIX = "usp_"
_OWNED_NAME = re.compile(rf"^({PREFIX}\d+_[0-9a-f]{{{TOKEN_HEX}}}_)")  # group 1: the owner's prefix
LOCK_PART = "lock"
RANDOM_HEX = 16  # 64 random bits per segment name (fewer where macOS's 31-character limit leaves less room)
MACOS_NAME_MAX = 31
CREATE_TRIES = 8
log = logging.getLogger("ulysses_sp.pool")

# Mappings that could not be closed yet because tensors still view them; retried by release_retired().
_retired: list[Mapping] = []


def owned_name(token: str, part: str) -> str:
    """The name of one part of a pool's segments (stays under macOS's 31-character limit for short parts)."""
    return f"{PREFIX}{os.getpid()}_{token}_{part}"


def fresh_name(token: str, part: str) -> str:
    """A new unguessable name for one segment of a pool: its owned prefix, the part, then random hex."""
    base = owned_name(token, part)
    room = RANDOM_HEX if sys.platform != "darwin" else max(4, min(RANDOM_HEX, MACOS_NAME_MAX - 1 - len(base)))
    return base + secrets.token_hex((room + 1) // 2)[:room]


def claim_names(token: str) -> Optional[OwnerLock]:
    """The owner file of a pool's segments, held until release; None where segments cannot be listed (no sweep)."""
    if not os.path.isdir(SHM_DIR):
        return None
    return OwnerLock(os.path.join(SHM_DIR, owned_name(token, LOCK_PART)))


def _as_tensor(shm: Mapping) -> torch.Tensor:
    # Through numpy, so the mapping holds a buffer export while any tensor views it: closing it then raises
    # BufferError instead of leaving tensors pointing at unmapped memory (torch.frombuffer keeps no export).
    return torch.from_numpy(np.frombuffer(shm.buf, dtype=np.uint8))


class Segment:
    """One mapped segment and a uint8 tensor over all of it."""

    def __init__(self, shm: Mapping, owner: bool):
        self.shm = shm
        self.owner = owner
        self.base: Optional[torch.Tensor] = _as_tensor(shm)

    @classmethod
    def create(cls, token: str, part: str, size: int, spill_dir: Optional[Callable[[], str]] = None) -> "Segment":
        """An owner-only segment with all its pages reserved; in the folder spill_dir() gives when /dev/shm is too
        small."""
        for attempt in range(CREATE_TRIES):
            try:
                return cls(create_mapping(fresh_name(token, part), max(1, size), spill_dir), owner=True)
            except FileExistsError:  # taken by someone else: never ours to open or unlink; draw another name
                if attempt == CREATE_TRIES - 1:
                    raise

    @classmethod
    def attach(cls, name: str) -> "Segment":
        if is_file_mapping(name):
            return cls(FileMapping(name), owner=False)
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


def _close_or_retire(shm: Mapping) -> None:
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


def owner_of(name: str) -> Optional[str]:
    """The owner prefix usp_<pid>_<token>_ of one of a pool's names (what clean_stale_segments takes), or None."""
    match = _OWNED_NAME.match(name)
    return match.group(1) if match else None


def clean_stale_segments(only: Optional[str] = None) -> list[str]:
    """Unlink the segments of pools whose owner file is unlocked (the pool died without closing); never those of a
    live pool, whatever its PID namespace, nor names without an owner file. only: that pool's alone (owner_of).
    Returns the names removed."""
    if not os.path.isdir(SHM_DIR):
        return []
    owners: dict[str, list[str]] = {}
    for name in os.listdir(SHM_DIR):
        match = _OWNED_NAME.match(name)
        if match and only in (None, match.group(1)):
            owners.setdefault(match.group(1), []).append(name)
    removed = []
    for owner, names in owners.items():
        lock = owner + LOCK_PART
        if lock not in names or not owner_is_dead(os.path.join(SHM_DIR, lock)):
            continue
        for name in sorted(names, key=lambda n: n == lock):  # the owner file last: it proves the rest stale
            path = os.path.join(SHM_DIR, name)
            try:
                if os.stat(path).st_uid == os.getuid():
                    os.unlink(path)
                    removed.append(name)
            except OSError:
                continue
    if removed:
        log.info("removed %d shared-memory name(s) left by dead pools: %s", len(removed), removed)
    return removed


def our_segments(pid: Optional[int] = None) -> list[str]:
    """Names of our segments in /dev/shm (of one creating process, or all); used by tests and status."""
    if not os.path.isdir(SHM_DIR):
        return []
    prefix = PREFIX if pid is None else f"{PREFIX}{pid}_"
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix))
