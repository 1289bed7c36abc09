"""The host side of LoRA: a checked, normalised list of (absolute path, strength), sent to the workers as JSON."""
from __future__ import annotations

import math
import os
from typing import Any, Sequence

LoraList = tuple[tuple[str, float], ...]


def normalize_loras(loras: Sequence[Any]) -> LoraList:
    """[[path, strength], ...] -> ((absolute path, float strength), ...); a clear error for anything else.

    Only checks that each file exists (a stat): the workers read the files.
    """
    if isinstance(loras, (str, bytes)) or not isinstance(loras, (list, tuple)):
        raise ValueError(f"loras must be a list of [path, strength] pairs, got {type(loras).__name__}")
    normalized = []
    for index, item in enumerate(loras):
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise ValueError(f"loras[{index}] must be a [path, strength] pair, got {item!r}")
        path, strength = item
        if not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"loras[{index}]: the path must be a string, got {type(path).__name__}")
        if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not math.isfinite(strength):
            raise ValueError(f"loras[{index}]: the strength must be a finite number, got {strength!r}")
        path = os.path.abspath(os.path.expanduser(os.fspath(path)))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"LoRA file {path!r} does not exist (loras[{index}])")
        normalized.append((path, float(strength)))
    return tuple(normalized)
