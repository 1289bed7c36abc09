"""Errors the worker pool raises to its caller, and how a worker's exit status is put into words."""
from __future__ import annotations

import signal
from typing import Optional

CPU_OUT_OF_MEMORY = "can't allocate memory"  # in torch's RuntimeError when a CPU allocation fails


class WorkerError(RuntimeError):
    """A worker died, could not start, or failed a request; the message names the rank, device and cause."""

    def __init__(self, message: str, rank: Optional[int] = None, device: Optional[str] = None):
        super().__init__(message)
        self.rank = rank
        self.device = device


class PoolStartError(WorkerError):
    """A worker could not start (device missing, process group init failed, out of memory ...)."""


class PoolClosedError(WorkerError):
    """The pool was closed; create a new WorkerPool."""


class PoolForkedError(WorkerError):
    """The pool was created by another process (this one is a fork of it); create a new WorkerPool here."""


class RemoteError(WorkerError):
    """An exception raised inside a worker, with its type, message and a short traceback."""

    def __init__(self, message: str, rank: Optional[int] = None, device: Optional[str] = None,
                 error_type: str = "", remote_message: str = "", remote_traceback: str = ""):
        super().__init__(message, rank, device)
        self.error_type = error_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback

    @property
    def out_of_memory(self) -> bool:
        message = self.remote_message.lower()
        return self.error_type in ("OutOfMemoryError", "MemoryError") or "out of memory" in message \
            or CPU_OUT_OF_MEMORY in message


def describe_exit(returncode: Optional[int]) -> str:
    """Words for a Popen return code: the signal name for a negative code, with the usual cause of SIGKILL."""
    if returncode is None:
        return "still running"
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    text = f"killed by {name}"
    if -returncode == signal.SIGKILL:
        text += (" (often the kernel's out-of-memory killer: check `dmesg` or `journalctl -k` for 'Killed process', "
                 "and lower the resolution, batch or number of workers if memory is short)")
    elif -returncode == signal.SIGSEGV:
        text += " (a crash in native code: a driver, NCCL or a CUDA kernel)"
    return text
