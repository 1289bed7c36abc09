"""Reading checkpoint tensors whatever the container and quantization: the one entry point the loaders and LoRA's
base-weight reader use (open_weights, then read_quant / read_plain per key)."""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from . import comfy_quant, gguf_file
from .detect import Quantization
from .weights import QuantWeight


@contextlib.contextmanager
def open_weights(path: str, device: torch.device | str) -> Iterator:
    """An open file with keys() and get_tensor(key): safetensors (mmap) or GGUF."""
    if gguf_file.is_gguf(path):
        with gguf_file.GGUFHandle(path, torch.device(device)) as handle:
            yield handle
        return
    from safetensors import safe_open
    with safe_open(path, framework="pt", device=str(device)) as handle:
        yield handle


def read_quant(handle, key: str, name: str, quant: Optional[Quantization]) -> Optional[QuantWeight]:
    """The quantized weight stored under `key` (`name`: the key with the file's prefix stripped), or None when the
    key holds a plain tensor."""
    if quant is None or name not in quant.layers:
        return None
    if quant.kind == "gguf":
        return handle.quant_weight(key)
    return comfy_quant.read_weight(handle, key[: -len(".weight")], quant.layers[name], set(handle.keys()))


def read_plain(handle, key: str, name: str, quant: Optional[Quantization]) -> torch.Tensor:
    """The tensor under `key` as a plain tensor: quantized weights dequantized to float32."""
    weight = read_quant(handle, key, name, quant)
    return handle.get_tensor(key) if weight is None else weight.dequantize(torch.float32)
