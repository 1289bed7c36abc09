"""GGUF diffusion-model files as ComfyUI-GGUF's converter writes them, read with the `gguf` package.

Layout (city96/ComfyUI-GGUF loader.py / tools/convert.py): `general.architecture` names the model (flux, qwen_image,
wan, ...); tensor names are ComfyUI's state-dict keys (sometimes under `model.diffusion_model.`); a tensor's torch
shape is its GGUF shape reversed, or `comfy.gguf.orig_shape.<name>` (an INT32 array) for tensors the converter
reshaped (e.g. 5-D convolutions). F32 / F16 / BF16 tensors are plain; quantized tensors are rows of blocks along the
last dimension. Blocks are dequantized with diffusers' torch GGUF dequantizers (they equal gguf's numpy reference,
tests/formats/test_formats.py checks every type), so no dequantizer is written here.
"""
from __future__ import annotations

import math
import warnings
from typing import Optional

import numpy as np
import torch

from .gguf_limits import check_gguf_header
from .weights import DEQUANTIZERS, QuantWeight

MAGIC = b"GGUF"
ARCHITECTURE_KEY = "general.architecture"
ORIGINAL_SHAPE_PREFIX = "comfy.gguf.orig_shape."
METADATA_ARCHITECTURE = "gguf.architecture"  # where read_header puts it in Header.metadata
PLAIN_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
INTEGER_TYPES = tuple(range(6)) + (10, 11)  # GGUFValueType's UINT8..INT32, UINT64, INT64


def is_gguf(path: str) -> bool:
    with open(path, "rb") as handle:
        return handle.read(4) == MAGIC


def _reader(path: str):
    """The gguf package's reader, after the bounded walk of gguf_limits (the package reads whatever a file states)."""
    import gguf
    check_gguf_header(path)
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError) as error:
        raise ValueError(f"{path!r} is not a readable GGUF file ({error}); download or convert it again") from None


def _original_shape(path: str, reader, tensor) -> Optional[tuple[int, ...]]:
    """The converter's torch shape of a reshaped tensor: integers holding exactly the tensor's elements."""
    import gguf
    field = reader.get_field(ORIGINAL_SHAPE_PREFIX + tensor.name)
    if field is None:
        return None
    shape = None
    if field.types[:1] == [gguf.GGUFValueType.ARRAY] and len(field.types) == 2 and field.types[1] in INTEGER_TYPES:
        shape = tuple(int(field.parts[index][0]) for index in field.data)
    if shape is None or min(shape, default=0) < 0 or math.prod(shape) != int(tensor.n_elements):
        raise ValueError(f"{path!r}: GGUF metadata {field.name!r} is not a shape of the tensor's "
                         f"{int(tensor.n_elements)} elements; download or convert the file again")
    return shape


def read_tensor_table(path: str) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict[str, str]]:
    """name -> (GGUF type name, torch shape), and {METADATA_ARCHITECTURE: ...}: what a safetensors header holds."""
    import gguf
    reader = _reader(path)
    tensors = {}
    for tensor in reader.tensors:
        shape = _original_shape(path, reader, tensor) or tuple(int(size) for size in reversed(tensor.shape))
        tensors[tensor.name] = (tensor.tensor_type.name, shape)
    field = reader.get_field(ARCHITECTURE_KEY)
    if field is not None and field.types != [gguf.GGUFValueType.STRING]:
        raise ValueError(f"{path!r}: GGUF metadata {ARCHITECTURE_KEY!r} is not a string")
    metadata = {} if field is None else {METADATA_ARCHITECTURE: str(field.parts[field.data[-1]], encoding="utf-8")}
    return tensors, metadata


def supported_types() -> tuple[str, ...]:
    from diffusers.quantizers.gguf.utils import dequantize_functions
    return tuple(sorted(kind.name for kind in dequantize_functions)) + tuple(PLAIN_TYPES)


def check_types(path: str, tensors: dict) -> None:
    """A clear error naming the quant types of the file that cannot be dequantized."""
    known = set(supported_types())
    unknown = sorted({kind for kind, _ in tensors.values()} - known)
    if unknown:
        raise ValueError(f"{path!r} holds GGUF tensors of type {', '.join(unknown)}, which is not supported; "
                         f"supported: {', '.join(supported_types())}")


class GGUFHandle:
    """safe_open-like access to one GGUF file: keys(), get_tensor(key) (plain, dequantized to float32 when the file
    quantized it) and quant_weight(key) (kept quantized)."""

    def __init__(self, path: str, device: torch.device):
        self.path = path
        self.reader = _reader(path)
        self.device = torch.device(device)
        self.entries = {tensor.name: tensor for tensor in self.reader.tensors}

    def keys(self):
        return list(self.entries)

    def shape(self, key: str) -> tuple[int, ...]:
        tensor = self.entries[key]
        return _original_shape(self.path, self.reader, tensor) or tuple(int(size) for size in reversed(tensor.shape))

    def _raw(self, key: str) -> torch.Tensor:
        with warnings.catch_warnings():  # the reader's arrays are read-only memory maps; we copy
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            array = np.ascontiguousarray(self.entries[key].data)
            return torch.from_numpy(array.view(np.uint8).copy()).to(self.device)

    def get_tensor(self, key: str) -> torch.Tensor:
        kind = self.entries[key].tensor_type.name
        if kind in PLAIN_TYPES:
            return self._raw(key).view(PLAIN_TYPES[kind]).reshape(self.shape(key))
        return self.quant_weight(key).dequantize(torch.float32)

    def quant_weight(self, key: str) -> QuantWeight:
        tensor = self.entries[key]
        stored = tuple(int(size) for size in reversed(tensor.shape))  # the shape the blocks run along
        rows = math.prod(stored[:-1])
        blocks = self._raw(key).reshape(rows, -1)
        return QuantWeight("gguf", self.shape(key), {"blocks": blocks},
                           params={"type": tensor.tensor_type.name})

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.reader = self.entries = None


def _dequantize_gguf(weight: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    import gguf
    from diffusers.quantizers.gguf.utils import dequantize_functions
    kind = gguf.GGMLQuantizationType[weight.params["type"]]
    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    blocks = weight.rows["blocks"]
    values = dequantize_functions[kind](blocks.reshape(-1, type_size), block_size, type_size, torch.float32)
    return values.reshape(weight.shape).to(dtype)


DEQUANTIZERS["gguf"] = _dequantize_gguf
