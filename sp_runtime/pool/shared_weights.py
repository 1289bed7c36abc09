"""CPU workers share one copy of a model's weights: while a model loads, every rank copies each weight it keeps into
the same place of a chain of shared-memory chunks (same file, same order, same bytes: the offsets agree), so the
pages exist once, not once per worker. Linux only (/dev/shm); elsewhere, or when /dev/shm is full, each rank keeps
its own copy as before.

The chunks are named by the host for each load (`<its owned name with 64 random bits>_<n>`); the first rank to
need a chunk creates it fully reserved under a temporary name and links it in place, the others map it. The host
unlinks the names once the load has ended: the pages live as long as a worker maps them (until it drops the model).
"""
from __future__ import annotations

import logging
import mmap
import os
import secrets
from typing import Optional

import numpy as np
import torch

from .mappings import SHM_DIR

CHUNK_BYTES = 64 << 20
ALIGN = 64
log = logging.getLogger("ulysses_sp.pool")


def can_share() -> bool:
    return os.path.isdir(SHM_DIR) and hasattr(os, "posix_fallocate")


def remove_chunks(base: str) -> None:
    """Unlink a load's chunk names (and temporary names) once no rank needs to find them any more."""
    if not os.path.isdir(SHM_DIR):
        return
    for name in os.listdir(SHM_DIR):
        if name.startswith(base + "_"):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except OSError:
                pass


class SharedWeights:
    """kept_copy for one load in one rank: tensor -> the same tensor in the shared chunks (or a private clone)."""

    def __init__(self, base: str):
        self.base = base
        self.index = 0
        self.chunk: Optional[torch.Tensor] = None
        self.offset = 0
        self.failed = False
        self.shared_bytes = 0

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        place = self._place(nbytes)  # always: the offsets stay those of the other ranks
        if place is None or self.failed:
            return tensor.clone()
        out = place.view(tensor.dtype).view(tensor.shape)
        out.copy_(tensor)
        self.shared_bytes += nbytes
        return out

    def _place(self, nbytes: int) -> Optional[torch.Tensor]:
        if nbytes == 0:
            return None
        if self.chunk is None or self.offset + nbytes > self.chunk.numel():
            size = max(CHUNK_BYTES, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
            name = f"{self.base}_{self.index}"
            self.index += 1
            self.chunk, self.offset = self._open(name, size), 0
        if self.chunk is None:
            return None
        start, self.offset = self.offset, self.offset + -(-nbytes // ALIGN) * ALIGN
        return self.chunk[start:start + nbytes]

    def _open(self, name: str, size: int) -> Optional[torch.Tensor]:
        if self.failed:
            return None
        try:
            return _map(name, size)
        except OSError as error:
            self.failed = True
            log.warning("CPU weights cannot be shared (%s): this worker keeps its own copy", error)
            return None


def _map(name: str, size: int) -> torch.Tensor:
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        fd = _create(path, size)
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid() or info.st_size != size:
            raise OSError(f"{path} is not this pool's weight chunk")
        mapping = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8))  # keeps the mapping while views exist


def _create(path: str, size: int) -> int:
    """A fully reserved chunk: made under a temporary name, then linked in place (the others never see it half
    made); when another rank linked first, its chunk."""
    temporary = f"{path}_tmp{secrets.token_hex(4)}"
    fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        os.link(temporary, path)
        return fd
    except FileExistsError:
        os.close(fd)
        return os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except BaseException:
        os.close(fd)
        raise
    finally:
        os.unlink(temporary)
