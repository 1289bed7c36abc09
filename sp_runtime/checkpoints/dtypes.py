"""Weight dtype names a load request may give, and their torch dtypes."""
from __future__ import annotations

import torch

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn, "fp8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2, "fp8_e5m2": torch.float8_e5m2,
}


def dtype_name(dtype: "torch.dtype | str | None") -> str:
    """Canonical name of a weight dtype ('default' keeps the checkpoint's own)."""
    if dtype is None or dtype == "default":
        return "default"
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of default, {', '.join(sorted(DTYPES))}")
    return str(DTYPES[dtype]).removeprefix("torch.")
