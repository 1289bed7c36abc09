"""The control segment: a cancel flag the host raises and workers read between blocks, per-rank counters of blocks
passed (the live progress of a call), and per-rank heartbeats (the host's liveness watchdog). Plain int64 words;
one writer per word.
"""
from __future__ import annotations

import struct
import threading
import time

from .segments import Segment

_CANCEL = 0
_WORLD = 8
_COUNTERS = 64  # one int64 per rank from here (a cache line away from the flag), then one heartbeat per rank
MAX_RANKS = 500
HEARTBEAT_S = 0.2


def control_size(world_size: int) -> int:
    return _COUNTERS + 16 * max(world_size, 1)


class ControlBlock:
    def __init__(self, segment: Segment):
        self.segment = segment
        self._buf = segment.shm.buf
        self._world = struct.unpack_from("<q", self._buf, _WORLD)[0]

    @classmethod
    def create(cls, token: str, world_size: int) -> "ControlBlock":
        if world_size > MAX_RANKS:
            raise ValueError(f"{world_size} workers is more than the {MAX_RANKS} the control block holds")
        segment = Segment.create(token, "c", control_size(world_size))
        struct.pack_into("<q", segment.shm.buf, _WORLD, max(world_size, 1))
        return cls(segment)

    @classmethod
    def attach(cls, name: str) -> "ControlBlock":
        return cls(Segment.attach(name))

    @property
    def name(self) -> str:
        return self.segment.name

    def set_cancel(self, value: bool) -> None:
        struct.pack_into("<q", self._buf, _CANCEL, int(value))

    def cancel_requested(self) -> bool:
        return struct.unpack_from("<q", self._buf, _CANCEL)[0] != 0

    def reset_counters(self, world_size: int) -> None:
        for rank in range(world_size):
            struct.pack_into("<q", self._buf, _COUNTERS + 8 * rank, 0)

    def bump(self, rank: int) -> None:
        self._increment(_COUNTERS + 8 * rank)

    def counter(self, rank: int) -> int:
        return struct.unpack_from("<q", self._buf, _COUNTERS + 8 * rank)[0]

    def heartbeat(self, rank: int) -> int:
        return struct.unpack_from("<q", self._buf, self._heartbeat_offset(rank))[0]

    def keep_beating(self, rank: int) -> None:
        """Bump this rank's heartbeat every HEARTBEAT_S from a daemon thread while the process runs (it stops
        when the process is stopped or a native call holds the interpreter)."""
        offset = self._heartbeat_offset(rank)

        def beat() -> None:
            try:
                while self._buf is not None:
                    self._increment(offset)
                    time.sleep(HEARTBEAT_S)
            except (TypeError, ValueError):  # released (or unmapped) while beating: the process is ending
                return
        threading.Thread(target=beat, name="usp-heartbeat", daemon=True).start()

    def mirror(self, rank: int, heartbeat: int, counter: int) -> None:
        """A joined machine's rank: its heartbeat and block counter as that machine reported them (the host's
        reader of that machine is the one writer of these words)."""
        struct.pack_into("<q", self._buf, self._heartbeat_offset(rank), int(heartbeat))
        struct.pack_into("<q", self._buf, _COUNTERS + 8 * rank, int(counter))

    def _heartbeat_offset(self, rank: int) -> int:
        return _COUNTERS + 8 * (self._world + rank)

    def _increment(self, offset: int) -> None:
        struct.pack_into("<q", self._buf, offset, struct.unpack_from("<q", self._buf, offset)[0] + 1)

    def release(self) -> None:
        self._buf = None
        self.segment.release()
