"""The tensors' byte ranges a file's header states (safetensors headers, GGUF tensor tables), checked before anything
is read or allocated: every range inside the data, no byte in two tensors."""
from __future__ import annotations

from typing import Iterable, Optional


def first_overlap(spans: Iterable[tuple[int, int, str]]) -> Optional[tuple[str, str]]:
    """Names of two tensors whose [begin, end) byte ranges overlap, or None."""
    previous, previous_end = None, 0
    for begin, end, name in sorted(spans):
        if begin < previous_end:
            return previous, name
        if end > previous_end:
            previous, previous_end = name, end
    return None
