"""A loaded model's runtime options inside a worker: its attention options (backend, FP8 exchange, overlap) made
current around each call, and its blocks compiled once when asked (load options attention, fp8_exchange, overlap,
compile, compile_backend; see sp_runtime.attention.options).
"""
from __future__ import annotations

from typing import Any

from .attention import leave_exchanges_to_eager
from .attention.backends import resolve
from .attention.options import RUNTIME_OPTION_KEYS, AttentionOptions, using
from .compile import compile_blocks


class OptionedModel:
    """A WorkerModel whose forward runs with its own attention options; everything else is the wrapped model's."""

    def __init__(self, inner, options: dict):
        self.inner = inner
        self.attention = AttentionOptions.from_load_options(options)
        resolve(self.attention.backend)  # a selected backend that is not installed fails the load, clearly
        compile_flag = options.get("compile", False)
        if not isinstance(compile_flag, bool):
            raise ValueError(f"load option compile must be true or false, got {compile_flag!r}")
        backend = options.get("compile_backend", "inductor")  # torch.compile's: "aot_eager" compiles in seconds
        if not isinstance(backend, str):
            raise ValueError(f"load option compile_backend must be a torch.compile backend name, got {backend!r}")
        if compile_flag:
            leave_exchanges_to_eager()  # the exchanges stay outside the compiled graphs
        self.compiled_blocks = compile_blocks(inner.model, backend=backend) if compile_flag else 0

    def forward(self, x, timestep, inputs: dict[str, Any], out, ctx) -> None:
        with using(self.attention):
            self.inner.forward(x, timestep, inputs, out, ctx)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def with_runtime_options(model, options: dict):
    """The model itself when no runtime option is set, else it wrapped in OptionedModel."""
    if not any(options.get(key) not in (None, False, "sdpa") for key in RUNTIME_OPTION_KEYS):
        return model
    return OptionedModel(model, options)
