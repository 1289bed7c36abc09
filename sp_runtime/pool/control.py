"""The control segment: a cancel flag the host raises and workers read between blocks, and per-rank counters of
blocks passed (the live progress of a call). Plain int64 words; one writer per word.
"""
from __future__ import annotations

import struct

from .segments import Segment

_CANCEL = 0
_COUNTERS = 64  # one int64 per rank from here (a cache line away from the flag)
MAX_RANKS = 500


def control_size(world_size: int) -> int:
    return _COUNTERS + 8 * max(world_size, 1)


class ControlBlock:
    def __init__(self, segment: Segment):
        self.segment = segment
        self._buf = segment.shm.buf

    @classmethod
    def create(cls, token: str, world_size: int) -> "ControlBlock":
        if world_size > MAX_RANKS:
            raise ValueError(f"{world_size} workers is more than the {MAX_RANKS} the control block holds")
        return cls(Segment.create(token, "c", control_size(world_size)))

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
        offset = _COUNTERS + 8 * rank
        struct.pack_into("<q", self._buf, offset, struct.unpack_from("<q", self._buf, offset)[0] + 1)

    def counter(self, rank: int) -> int:
        return struct.unpack_from("<q", self._buf, _COUNTERS + 8 * rank)[0]

    def release(self) -> None:
        self._buf = None
        self.segment.release()
