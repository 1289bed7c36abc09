"""Proof of whose a pool's names in shared places are: a random token in every name, and an owner file the live pool
holds an flock on. PIDs prove nothing across PID namespaces (two containers sharing /dev/shm or /tmp); a lock does.
"""
from __future__ import annotations

import fcntl
import os
import secrets

TOKEN_HEX = 8


def new_token() -> str:
    """A random per-pool token: names stay unique where two processes have the same PID."""
    return secrets.token_hex(TOKEN_HEX // 2)


class OwnerLock:
    """An owner-only file locked (flock) for as long as its owner lives: the kernel drops the lock when the owner
    dies, however it dies, so a later sweep can tell a dead owner's names from a live one's."""

    def __init__(self, path: str):
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.forget()
            raise

    def release(self) -> None:
        """Remove the file (call after removing what it guards), then drop the lock."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self.forget()

    def forget(self) -> None:
        """Close this process's descriptor without unlinking (a forked child): the lock belongs to the open file,
        so the owner that still holds it keeps it."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def owner_is_dead(path: str) -> bool:
    """True only when the owner file exists, is ours, and nobody holds its lock (its owner died without cleaning)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return False  # gone, or not ours to open: nothing proves its owner dead
    try:
        if os.fstat(fd).st_uid != os.getuid():
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False  # held: its owner is alive
    finally:
        os.close(fd)
