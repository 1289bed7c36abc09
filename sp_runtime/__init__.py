"""ulysses-sp runtime: worker pool, transport, sequence-parallel attention and model families (no ComfyUI here)."""
from __future__ import annotations

import importlib

from .config import SPConfig, valid_layouts

__version__ = "0.1.0"

# Heavier pieces load on first use so `import sp_runtime` stays cheap in the ComfyUI process.
_LAZY = {
    "WorkerPool": "sp_runtime.pool",
    "ModelHandle": "sp_runtime.pool",
    "WorkerError": "sp_runtime.pool",
    "Cancelled": "sp_runtime.contract",
    "SeqShards": "sp_runtime.attention",
    "sp_attention": "sp_runtime.attention",
}

__all__ = ["SPConfig", "valid_layouts", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sp_runtime' has no attribute {name!r}")
