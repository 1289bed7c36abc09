"""A bounded walk over a GGUF file's header (metadata, tensor table, data ranges) before the `gguf` package parses it:
the package reads any count, length and nesting a file states, so a crafted file could hold the process for minutes
or exhaust its memory. Errors name the file, the field and the limit.

Layout (GGUF v2 / v3, little-endian): magic, version u32, tensor count u64, metadata count u64; each metadata entry
a string key, a u32 value type and the value (strings: u64 length + bytes; arrays: u32 item type, u64 count,
items); each tensor a string name, u32 dims, u64 per dim, u32 type, u64 offset into the aligned data section.
"""
from __future__ import annotations

import math
import os
import struct

from .byte_ranges import first_overlap

MAX_METADATA_BYTES = 1024 * 1024      # ComfyUI-GGUF diffusion files hold a few hundred bytes of metadata
MAX_METADATA_VALUES = 65536           # array items, all entries together
MAX_STRING_BYTES = 65536
MAX_NESTING = 2                       # an array of arrays at most
MAX_TENSORS = 65536                   # the largest diffusion models have a few thousand
MAX_TENSOR_BYTES = 16 * 1024 * 1024   # the tensor table (names, shapes, offsets)
MAX_DIMS = 4                          # GGML_MAX_DIMS
SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> bytes
STRING, ARRAY, UINT32 = 8, 9, 4
DEFAULT_ALIGNMENT = 32


class _Cursor:
    """Reads a file forward, refusing to pass `limit` (the section's cap) or the end of the file."""

    def __init__(self, handle, path: str, size: int):
        self.handle, self.path, self.size = handle, path, size
        self.what, self.cap, self.limit = "", 0, 0

    def section(self, what: str, cap: int) -> None:
        self.what, self.cap, self.limit = what, cap, self.handle.tell() + cap

    def take(self, count: int, field: str) -> bytes:
        end = self.handle.tell() + count
        if end > self.size:
            raise ValueError(f"{self.path!r}: the GGUF file ends inside {field} (it states more than the file holds); "
                             f"download or convert it again")
        if end > self.limit:
            raise ValueError(f"{self.path!r}: the GGUF {self.what} is larger than the limit of {self.cap} bytes "
                             f"(at {field}); this is not a diffusion-model file ulysses-sp loads")
        return self.handle.read(count)

    def number(self, form: str, field: str) -> int:
        return struct.unpack("<" + form, self.take(struct.calcsize(form), field))[0]

    def string(self, field: str) -> str:
        length = self.number("Q", field)
        if length > MAX_STRING_BYTES:
            raise ValueError(f"{self.path!r}: GGUF {field} is a string of {length} bytes, more than the limit of "
                             f"{MAX_STRING_BYTES}")
        return self.take(length, field).decode("utf-8", errors="replace")


def check_gguf_header(path: str) -> None:
    """ValueError naming the file, field and limit unless the header is within every limit and each tensor's bytes
    lie inside the file without overlapping another's."""
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        cursor = _Cursor(handle, path, size)
        cursor.section("header", 24)
        if cursor.take(4, "the magic") != b"GGUF":
            raise ValueError(f"{path!r} is not a GGUF file")
        version = cursor.number("I", "the version")
        if version not in (2, 3):
            raise ValueError(f"{path!r}: GGUF version {version} (as little-endian) is not supported; versions 2 and "
                             f"3 little-endian load")
        tensor_count, entry_count = cursor.number("Q", "the tensor count"), cursor.number("Q", "the metadata count")
        if tensor_count > MAX_TENSORS:
            raise ValueError(f"{path!r}: GGUF tensor count {tensor_count} is more than the limit of {MAX_TENSORS}")
        cursor.section("metadata", MAX_METADATA_BYTES)
        alignment = _walk_metadata(cursor, entry_count)
        cursor.section("tensor table", MAX_TENSOR_BYTES)
        tensors = [_tensor_info(cursor, index) for index in range(tensor_count)]
        data_start = -(-handle.tell() // alignment) * alignment
    _check_ranges(path, tensors, size - data_start)


def _walk_metadata(cursor: _Cursor, entry_count: int) -> int:
    """Skip over every metadata value within the limits; returns general.alignment (32 when absent)."""
    budget = [MAX_METADATA_VALUES]
    alignment = DEFAULT_ALIGNMENT
    for index in range(entry_count):  # each entry takes >= 12 bytes: the byte cap ends a huge count
        key = cursor.string(f"metadata entry #{index}'s key")
        kind = cursor.number("I", f"metadata {key!r}'s type")
        if key == "general.alignment" and kind == UINT32:
            alignment = cursor.number("I", f"metadata {key!r}")
            if alignment == 0 or alignment & (alignment - 1):
                raise ValueError(f"{cursor.path!r}: GGUF general.alignment {alignment} is not a power of two")
            continue
        _skip_value(cursor, kind, f"metadata {key!r}", 0, budget)
    return alignment


def _skip_value(cursor: _Cursor, kind: int, field: str, depth: int, budget: list) -> None:
    if kind in SCALAR_SIZES:
        cursor.take(SCALAR_SIZES[kind], field)
    elif kind == STRING:
        cursor.string(field)
    elif kind == ARRAY:
        if depth >= MAX_NESTING:
            raise ValueError(f"{cursor.path!r}: GGUF {field} nests arrays deeper than the limit of {MAX_NESTING}")
        item_kind, count = cursor.number("I", field), cursor.number("Q", field)
        budget[0] -= count
        if budget[0] < 0:
            raise ValueError(f"{cursor.path!r}: GGUF {field} brings the metadata past the limit of "
                             f"{MAX_METADATA_VALUES} values")
        if item_kind in SCALAR_SIZES:
            cursor.take(SCALAR_SIZES[item_kind] * count, field)
        else:
            for _ in range(count):
                _skip_value(cursor, item_kind, field, depth + 1, budget)
    else:
        raise ValueError(f"{cursor.path!r}: GGUF {field} has the unknown value type {kind}")


def _tensor_info(cursor: _Cursor, index: int) -> tuple[str, tuple[int, ...], int, int]:
    name = cursor.string(f"tensor #{index}'s name")
    dims = cursor.number("I", f"tensor {name!r}'s dimension count")
    if dims > MAX_DIMS:
        raise ValueError(f"{cursor.path!r}: GGUF tensor {name!r} has {dims} dimensions, more than the limit of "
                         f"{MAX_DIMS}")
    shape = tuple(cursor.number("Q", f"tensor {name!r}'s shape") for _ in range(dims))
    return name, shape, cursor.number("I", f"tensor {name!r}'s type"), cursor.number("Q", f"tensor {name!r}'s offset")


def _check_ranges(path: str, tensors: list, data_bytes: int) -> None:
    """Each tensor's bytes (its type's block size x its element count) inside the data section; none overlap."""
    import gguf
    spans = []
    for name, shape, kind, offset in tensors:
        try:
            block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise ValueError(f"{path!r}: GGUF tensor {name!r} has the unknown type {kind}") from None
        if shape and shape[0] % block:
            raise ValueError(f"{path!r}: GGUF tensor {name!r}'s rows of {shape[0]} do not split into blocks of "
                             f"{block}")
        end = offset + math.prod(shape) // block * block_bytes
        if end > data_bytes:
            raise ValueError(f"{path!r}: GGUF tensor {name!r} (shape {list(shape)}) ends at byte {end} of the data, "
                             f"but the file holds {data_bytes}; download or convert it again")
        spans.append((offset, end, name))
    overlap = first_overlap(spans)
    if overlap:
        raise ValueError(f"{path!r}: GGUF tensors {overlap[0]!r} and {overlap[1]!r} overlap in the file; download or "
                         f"convert it again")
