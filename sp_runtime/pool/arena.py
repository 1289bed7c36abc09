"""Host-side arenas: the input arena (call arguments, each kept while unchanged so it is not copied again) and the
output arena (where every rank writes its share of the result, handed to the caller in place). Both grow
geometrically and are reused.
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .protocol import dtype_to_name
from .segments import Segment, nbytes_of

ALIGN = 64          # cache-line aligned offsets; also keeps every dtype view aligned
MIN_CAPACITY = 1 << 20
RECENT_COPIES = 2   # per argument: e.g. cond and uncond sent in alternate calls both stay resident


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _grown(capacity: int, needed: int) -> int:
    return max(MIN_CAPACITY, needed, 2 * capacity)


def _version_of(tensor: torch.Tensor) -> Optional[int]:
    """In-place version counter, or None for inference tensors (ComfyUI samples under torch.inference_mode(),
    whose tensors track no version): those are matched by content, never by object identity."""
    return None if tensor.is_inference() else tensor._version


@dataclass
class _Slot:
    """One argument's bytes in the arena; version names its content (workers cache device copies by it)."""

    offset: int
    capacity: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    version: int
    source: Optional[weakref.ref] = field(default=None, repr=False)
    source_version: Optional[int] = -1
    source_ptr: int = 0

    def remember(self, tensor: torch.Tensor) -> None:
        self.source = weakref.ref(tensor)
        self.source_version = _version_of(tensor)
        self.source_ptr = tensor.data_ptr()

    def holds_same_object(self, tensor: torch.Tensor) -> bool:
        version = _version_of(tensor)
        return (version is not None and self.source is not None and self.source() is tensor
                and version == self.source_version and tensor.data_ptr() == self.source_ptr)

    def spec(self, name: str) -> dict:
        return {"name": name, "dtype": dtype_to_name(self.dtype), "shape": list(self.shape),
                "offset": self.offset, "version": self.version}


class InputArena:
    """Call arguments in one shared segment; an argument equal to a resident copy is not copied again."""

    def __init__(self, token: str, spill_dir: Optional[Callable[[], str]] = None):
        self._token = token
        self._spill_dir = spill_dir  # gives the folder segments go to when /dev/shm is too small
        self._generation = itertools.count()
        self._versions = itertools.count(1)
        self.segment: Optional[Segment] = None
        self._slots: dict[str, list[_Slot]] = {}  # most recently used first
        self._end = 0

    @property
    def capacity(self) -> int:
        return self.segment.size if self.segment else 0

    def live_versions(self) -> list[int]:
        return [slot.version for slots in self._slots.values() for slot in slots]

    def stage(self, tensors: dict[str, torch.Tensor], always_copy: frozenset = frozenset()
              ) -> tuple[list[dict], dict[str, int]]:
        """Place every tensor in the arena; return (specs for the workers, bytes copied per name).

        Names in always_copy (x: it changes every call) are copied without looking for a resident copy.
        """
        found = {name: None if name in always_copy else self._find(name, tensor) for name, tensor in tensors.items()}
        missing = [name for name, slot in found.items() if slot is None]
        placed = {name: self._place(name, tensors[name]) for name in missing}
        if any(slot is None for slot in placed.values()):
            found = self._compact(tensors, found)
            missing = list(tensors)
        else:
            found.update(placed)
        copied = {}
        for name in missing:
            slot = found[name]
            self.segment.view(slot.offset, slot.dtype, slot.shape).copy_(tensors[name].detach())
            slot.remember(tensors[name])
            copied[name] = nbytes_of(slot.dtype, slot.shape)
        return [found[name].spec(name) for name in tensors], copied

    def _find(self, name: str, tensor: torch.Tensor) -> Optional[_Slot]:
        """A resident slot with this exact content: the same unmodified tensor object, or equal bytes."""
        candidates = [slot for slot in self._slots.get(name, ())
                      if slot.dtype == tensor.dtype and slot.shape == tuple(tensor.shape)]
        match = next((slot for slot in candidates if slot.holds_same_object(tensor)), None)
        if match is None:
            for slot in candidates:
                resident = self.segment.view(slot.offset, slot.dtype, slot.shape)
                if torch.equal(resident, tensor.detach().cpu()):
                    slot.remember(tensor)
                    match = slot
                    break
        if match is not None:
            self._touch(name, match)
        return match

    def _touch(self, name: str, slot: _Slot) -> None:
        slots = self._slots[name]
        slots.remove(slot)
        slots.insert(0, slot)

    def _place(self, name: str, tensor: torch.Tensor) -> Optional[_Slot]:
        """A slot for new content: the oldest copy of this name if full and large enough, else fresh space."""
        nbytes = _aligned(nbytes_of(tensor.dtype, tensor.shape))
        slots = self._slots.setdefault(name, [])
        keep = 1 if name == "x" else RECENT_COPIES
        if len(slots) >= keep and slots[-1].capacity >= nbytes:
            slot = slots.pop()
            slot.dtype, slot.shape = tensor.dtype, tuple(tensor.shape)
        else:
            if self._end + nbytes > self.capacity:
                return None
            slot = _Slot(self._end, nbytes, tensor.dtype, tuple(tensor.shape), 0)
            self._end += nbytes
            del slots[keep - 1:]
        slot.version = next(self._versions)
        slot.source = None
        slots.insert(0, slot)
        return slot

    def _compact(self, tensors: dict[str, torch.Tensor], found: dict[str, Optional[_Slot]]) -> dict[str, _Slot]:
        """Lay out only this call's tensors from offset 0 (growing the segment if needed); all are copied again.

        A tensor whose content was found resident keeps its version, so workers keep its device copy.
        """
        needed = sum(_aligned(nbytes_of(t.dtype, t.shape)) for t in tensors.values())
        if needed > self.capacity:
            self._replace_segment(_grown(self.capacity, needed))
        self._slots, self._end, layout = {}, 0, {}
        for name, tensor in tensors.items():
            nbytes = _aligned(nbytes_of(tensor.dtype, tensor.shape))
            kept = found.get(name)
            version = kept.version if kept is not None else next(self._versions)
            slot = _Slot(self._end, nbytes, tensor.dtype, tuple(tensor.shape), version)
            self._end += nbytes
            self._slots[name] = [slot]
            layout[name] = slot
        return layout

    def _replace_segment(self, size: int) -> None:
        old, self.segment = self.segment, Segment.create(self._token, f"i{next(self._generation)}", size,
                                                         self._spill_dir)
        if old is not None:
            old.release()

    def release(self) -> None:
        if self.segment is not None:
            self.segment.release()
        self.segment, self._slots, self._end = None, {}, 0


class OutputArena:
    """One result at a time, at offset 0, handed to the caller in place (a view of the segment, no copy). While the
    caller still holds a result (or any view of it), the next call gets a new segment, so a result never changes
    under its holder; a caller that drops each result before the next call (ComfyUI's samplers) reuses one segment.
    Grown geometrically when a larger result comes."""

    def __init__(self, token: str, spill_dir: Optional[Callable[[], str]] = None):
        self._token = token
        self._spill_dir = spill_dir  # gives the folder segments go to when /dev/shm is too small
        self._generation = itertools.count()
        self.segment: Optional[Segment] = None
        self._idle_uses = 0  # the segment's storage use count with no result alive

    def region(self, dtype: torch.dtype, shape: tuple[int, ...]) -> dict:
        needed = nbytes_of(dtype, shape)
        if self.segment is None or needed > self.segment.size or self.result_alive():
            old = self.segment
            size = old.size if old is not None and needed <= old.size else _grown(old.size if old else 0, needed)
            self.segment = Segment.create(self._token, f"o{next(self._generation)}", size, self._spill_dir)
            self._idle_uses = _uses(self.segment)
            if old is not None:
                old.release()  # unmapped once the caller drops the result that still views it
        return {"segment": self.segment.name, "dtype": dtype_to_name(dtype), "shape": list(shape), "offset": 0}

    def result_alive(self) -> bool:
        """Whether a result handed out from the current segment (or a view of it) is still referenced."""
        return self.segment is not None and _uses(self.segment) > self._idle_uses

    def read(self, region: dict, dtype: torch.dtype) -> torch.Tensor:
        """The result in place: a CPU tensor viewing the segment (the next call writes elsewhere while it lives); a
        private copy on a torch that cannot count the segment's users."""
        view = self.segment.view(0, dtype, tuple(region["shape"]))
        return view if _USE_COUNT is not None else view.clone()

    def release(self) -> None:
        if self.segment is not None:
            self.segment.release()
        self.segment = None


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)  # private; older or newer torch may lack it


def _uses(segment: Segment) -> int:
    """References to the storage under the segment's tensor: one per tensor viewing it (besides the segment's)."""
    return _USE_COUNT(segment.base.untyped_storage()._cdata) if _USE_COUNT is not None else 0

