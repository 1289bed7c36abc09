"""Per-model attention options inside a worker (backend, FP8 exchange, overlap): parsed from a model's load options
and made current around each of its calls, so sp_attention reads them without every family passing them down.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

BACKENDS = ("sdpa", "auto", "flash", "flash2", "flash3", "sage")
# load options this module and sp_runtime.compile read; families ignore them
RUNTIME_OPTION_KEYS = ("attention", "fp8_exchange", "overlap", "compile")


@dataclass(frozen=True)
class AttentionOptions:
    """backend: one of BACKENDS (sdpa = torch's SDPA, the default); fp8_exchange: Ulysses all-to-alls carry 8-bit
    (q, k, v) and 12-bit (output) integer codes with one scale per token and head (attention.fp8_exchange);
    overlap: the output exchange runs in head chunks overlapped with the attention of the next chunk."""

    backend: str = "sdpa"
    fp8_exchange: bool = False
    overlap: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"attention backend {self.backend!r} is unknown; use one of {', '.join(BACKENDS)}")

    @classmethod
    def from_load_options(cls, options: dict) -> "AttentionOptions":
        return cls(backend=str(options.get("attention") or "sdpa"), fp8_exchange=_flag(options, "fp8_exchange"),
                   overlap=_flag(options, "overlap"))


def _flag(options: dict, name: str) -> bool:
    value = options.get(name, False)
    if not isinstance(value, bool):
        raise ValueError(f"load option {name} must be true or false, got {value!r}")
    return value


# A module global, not a ContextVar: torch.compile traces a global read (and guards on it) but breaks the graph at
# ContextVar.get. A worker runs one call at a time, so a global is enough.
_current = AttentionOptions()


def current() -> AttentionOptions:
    return _current


@contextmanager
def using(options: AttentionOptions) -> Iterator[AttentionOptions]:
    global _current
    previous, _current = _current, options
    try:
        yield options
    finally:
        _current = previous
