"""A worker's guard against outliving its host: when the host process dies (killed, or SIGTERM to the whole process
group as systemd or a supervisor sends it), the worker removes the host's shared-memory segments and run folder,
which the host had no chance to remove, and exits. Only its own host's, and only once the host's owner files prove
it dead (ownership.py).
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

from .segments import clean_stale_segments, owner_of
from .spawn import remove_if_dead

POLL_S = 0.5
PARENT_EXIT_WAIT_S = 1.0  # after a SIGTERM, how long to wait for the host to go too (a signal to the group)
PR_SET_PDEATHSIG = 1


def guard(parent_pid: int, control_name: str, run_dir: str) -> None:
    """Call once from the worker's main thread, before anything else starts threads. control_name: the host's
    control segment (its name says whose segments are the host's)."""
    cleanup = _Cleanup(parent_pid, control_name, run_dir)
    if sys.platform.startswith("linux"):
        try:  # the kernel signals us when the spawning thread (the pool's long-lived spawner) ends
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:
        cleanup.exit(3)
    # SIGTERM is handled on a thread woken through the wakeup fd: the main thread may sit in a collective or a
    # native op for a long time, and a Python-level handler only runs when it returns.
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    signal.signal(signal.SIGTERM, lambda *_: None)
    threading.Thread(target=cleanup.on_signal, args=(read_end,), name="usp-sigterm", daemon=True).start()
    threading.Thread(target=cleanup.watch_parent, name="usp-parent-watchdog", daemon=True).start()


class _Cleanup:
    def __init__(self, parent_pid: int, control_name: str, run_dir: str):
        self.parent_pid = parent_pid
        self.host = owner_of(control_name)
        self.run_dir = run_dir
        self._lock = threading.Lock()

    def parent_gone(self) -> bool:
        return os.getppid() != self.parent_pid

    def watch_parent(self) -> None:
        while True:
            time.sleep(POLL_S)
            if self.parent_gone():
                self.exit(3)

    def on_signal(self, read_end: int) -> None:
        while int(signal.SIGTERM) not in os.read(read_end, 64):
            pass
        deadline = time.monotonic() + PARENT_EXIT_WAIT_S
        while not self.parent_gone() and time.monotonic() < deadline:
            time.sleep(0.02)
        self.exit(128 + signal.SIGTERM)

    def exit(self, status: int) -> None:
        """Remove what the dead host left (nothing while it lives: it removes its own), then end the process."""
        with self._lock:
            if self.parent_gone():
                if self.host is not None:
                    clean_stale_segments(self.host)
                remove_if_dead(self.run_dir)
            os._exit(status)
