"""How a segment's memory is mapped: POSIX shared memory with every page reserved when it is created, or, when
/dev/shm is too small (Docker's default is 64 MB), an owner-only file in the pool's private run folder.

Reserving up front (posix_fallocate) turns "no space" into an error at creation; without it, tmpfs hands out
pages on first write and a full /dev/shm kills the writing process (host or worker) with SIGBUS.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
from multiprocessing.shared_memory import SharedMemory
from typing import Callable, Optional, Union

SHM_DIR = "/dev/shm"  # where Linux shows POSIX shared memory; elsewhere stale segments are not listed
NO_SPACE = (errno.ENOSPC, errno.ENOMEM, errno.EFBIG)
MIB = 1 << 20
log = logging.getLogger("ulysses_sp.pool")


class SharedMemoryFull(MemoryError):
    """Neither /dev/shm nor the fallback folder can hold a segment; the message says what to do."""


class FileMapping:
    """A mapped file with the parts of SharedMemory's interface the pool uses (name is the file's path)."""

    def __init__(self, path: str, size: int = 0, create: bool = False):
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                try:
                    _reserve(fd, size)
                except OSError:
                    os.unlink(path)
                    raise
            self.size = os.fstat(fd).st_size
            self._mmap: Optional[mmap.mmap] = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.name = path
        self.buf: Optional[memoryview] = memoryview(self._mmap)

    def close(self) -> None:
        if self.buf is not None:
            self.buf.release()  # BufferError while a tensor still views it, as SharedMemory.close()
            self.buf = None
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None

    def unlink(self) -> None:
        os.unlink(self.name)


Mapping = Union[SharedMemory, FileMapping]


def create_mapping(name: str, size: int, spill_dir: Optional[Callable[[], str]]) -> Mapping:
    """Shared memory of `size` bytes, all reserved; a file in the folder spill_dir() gives when /dev/shm cannot
    hold it."""
    shm = SharedMemory(name=name, create=True, size=size)  # mode 0600 (owner only)
    try:
        _reserve(shm._fd, size)
        return shm
    except OSError as error:
        shm.close()
        shm.unlink()
        if error.errno not in NO_SPACE or spill_dir is None:
            raise
    return _spill(name, size, spill_dir())


def _spill(name: str, size: int, spill_dir: str) -> FileMapping:
    free = shm_free_bytes()
    try:
        os.makedirs(spill_dir, mode=0o700, exist_ok=True)
        mapping = FileMapping(os.path.join(spill_dir, name), size, create=True)
    except OSError as error:
        raise SharedMemoryFull(
            f"not enough shared memory: {SHM_DIR} has {free / MIB:.0f} MiB free and the pool needs a {size / MIB:.0f}"
            f" MiB segment, and the fallback file in {spill_dir} failed too ({error}). Give the container more "
            f"shared memory (docker run --shm-size=8g, or `shm_size: 8gb` in docker compose), free space in "
            f"{SHM_DIR}, or lower the resolution, frame count or batch") from None
    log.warning("%s has %.0f MiB free, too little for a %.0f MiB segment: using a file in %s instead (slower; "
                "in Docker, --shm-size=8g avoids this)", SHM_DIR, free / MIB, size / MIB, spill_dir)
    return mapping


def _reserve(fd: int, size: int) -> None:
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, size)
    else:  # macOS: no reservation; sizing is all there is
        os.ftruncate(fd, size)


def is_file_mapping(name: str) -> bool:
    return os.path.isabs(name)


def shm_free_bytes() -> int:
    try:
        stat = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return stat.f_bavail * stat.f_frsize
