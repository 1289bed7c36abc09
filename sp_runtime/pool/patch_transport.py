"""A PatchSet's trip to the workers: its tensors laid out in one owner-only shared-memory segment for the one
request that carries the set (its description travels as JSON), read back by each worker into its own CPU copies,
and the sets each worker keeps per model (a few, most recent first), mirrored on the host so a set is sent once.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Callable, Optional

from ..lora.patch_set import PatchSet
from .arena import ALIGN
from .protocol import dtype_to_name, name_to_dtype
from .segments import Segment, nbytes_of

SETS_KEPT = 3  # patch sets each worker keeps per model (CPU copies): switching back to one sends nothing
_parts = itertools.count()


def stage_patch_set(patches: PatchSet, token: str, spill_dir: Optional[Callable[[], str]] = None
                    ) -> tuple[dict, Segment]:
    """The "patches" entry of a set_loras request with the set's tensors in a new segment (the caller releases
    it once the workers replied)."""
    description, tensors = patches.to_message()
    specs, offset = [], 0
    for name, tensor in tensors.items():
        specs.append({"name": name, "dtype": dtype_to_name(tensor.dtype), "shape": list(tensor.shape),
                      "offset": offset})
        offset += -(-nbytes_of(tensor.dtype, tensor.shape) // ALIGN) * ALIGN
    segment = Segment.create(token, f"p{next(_parts)}", offset, spill_dir)
    for spec in specs:
        tensor = tensors[spec["name"]]
        segment.view(spec["offset"], tensor.dtype, tuple(tensor.shape)).copy_(tensor.detach())
    return {"digest": patches.digest, "set": description, "segment": segment.name, "tensors": specs}, segment


def read_patch_set(entry: dict) -> PatchSet:
    """The set of a "patches" entry that carries one, its tensors copied out of the segment (worker side)."""
    segment = Segment.attach(entry["segment"])
    try:
        tensors = {spec["name"]: segment.view(spec["offset"], name_to_dtype(spec["dtype"]), tuple(spec["shape"]))
                   .clone() for spec in entry["tensors"]}
    finally:
        segment.release()
    return PatchSet.from_message(entry["set"], tensors.__getitem__)


class KeptSets:
    """The patch sets kept for one model, most recently used last; the host keeps the same order of digests."""

    def __init__(self):
        self.sets: "OrderedDict[str, Optional[PatchSet]]" = OrderedDict()

    def use(self, digest: str, patches: Optional[PatchSet] = None) -> Optional[PatchSet]:
        """Mark `digest` used (adding `patches` under it when given); returns what is kept under it."""
        if patches is not None or digest not in self.sets:
            self.sets[digest] = patches
        self.sets.move_to_end(digest)
        while len(self.sets) > SETS_KEPT:
            self.sets.popitem(last=False)
        return self.sets[digest]

    def __contains__(self, digest: str) -> bool:
        return digest in self.sets
