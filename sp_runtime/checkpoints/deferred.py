"""Tensor-parallel loading: while `deferred_loading` is active, load_weights leaves the Linear / RMSNorm weights of
the model unread (meta) and records where each comes from; once tensor parallelism has split the empty model,
`read_deferred` reads each rank's slice of them from the file (safetensors get_slice: only the pages holding those
rows / columns are touched) and the weights TP does not split whole. Peak memory is then the rank's share, not the
whole model.

A weight whose key-plan transform selects rows (a rename, a fused q / k / v cut into its parts, halves swapped) is
read as those rows only; any other transform (a reshape, a concatenation) is read whole, transformed, then sliced.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from .kept import cast_weight, out_of_file

_active = False  # a module global, as sharding.streaming's: the families' loaders need not pass it down


@contextlib.contextmanager
def deferred_loading(active: bool) -> Iterator[None]:
    """While active, load_weights defers the model's Linear / RMSNorm weights (see read_deferred)."""
    global _active
    previous, _active = _active, active
    try:
        yield
    finally:
        _active = previous


@dataclass(frozen=True)
class Source:
    """Where a deferred weight comes from: file, key, the key plan's transform, its final dtype."""

    file: str
    key: str
    transform: Optional[object]
    dtype: Optional[torch.dtype]


def deferrable(model: torch.nn.Module) -> set[str]:
    """The parameters load_weights defers while deferred_loading is active (none otherwise): those of the kinds
    sp.tensor_parallel splits."""
    if not _active:
        return set()
    return {f"{name}.{attribute}" for name, module in model.named_modules()
            if isinstance(module, (torch.nn.Linear, torch.nn.RMSNorm))
            for attribute, value in module._parameters.items() if value is not None}


def read_deferred(model: torch.nn.Module, slices: dict, device: torch.device | str) -> int:
    """Read the weights load_weights deferred (model._deferred_weights): this rank's slice (sp.tensor_parallel.TPSlice
    in `slices`, by parameter name) or the whole tensor. Returns the bytes read from the files (a tensor read whole counts whole)."""
    deferred: dict[str, Source] = model.__dict__.pop("_deferred_weights", {})
    device, read = torch.device(device), 0
    by_file: dict[str, list[tuple[str, Source]]] = {}
    for name, source in deferred.items():
        by_file.setdefault(source.file, []).append((name, source))
    for file, entries in by_file.items():
        handle = _Reopening(file, device)
        try:
            for name, source in entries:
                piece = slices.get(name)
                value = _read_rows(handle.get(), source, piece) if piece is not None else None
                if value is None:
                    whole = handle.get().get_tensor(source.key)
                    value = source.transform(whole) if source.transform else whole
                    value = cast_weight(piece.take(value) if piece else value, source.dtype)
                    # a slice stays private: the pool's CPU ranks share kept copies by position (pool.shared_weights)
                    value = out_of_file(value, whole) if piece is None else _private(value, whole)
                    handle.touched(whole.numel() * whole.element_size())
                    read += whole.numel() * whole.element_size()
                else:
                    # a column slice touches the pages of every row (up to its whole tensor), a row slice its rows
                    rows_read = math.prod(piece.full_shape) if piece.dim == 1 else value.numel()
                    handle.touched(rows_read * value.element_size())
                    read += value.numel() * value.element_size()
                    value = cast_weight(value, source.dtype)
                _assign(model, name, value)
        finally:
            handle.close()
    unread = [name for name, parameter in model.named_parameters() if parameter.is_meta]
    if unread:  # a module a family loaded apart from its model: its weights would stay unread
        raise ValueError(f"tensor-parallel loading left {len(unread)} weights unread (e.g. {unread[:3]}): this "
                         f"family's loader is not supported at tensor parallelism")
    return read


class _Reopening:
    """A safetensors file reopened after every REOPEN_BYTES of its mapping touched: the pages a slice read touches
    (a column slice touches every row's pages) count in the process's resident set until the mapping closes."""

    REOPEN_BYTES = 256 * 2 ** 20

    def __init__(self, file: str, device: torch.device):
        self.file, self.device, self.handle, self.context, self.bytes = file, device, None, None, 0

    def get(self):
        if self.handle is None:
            from safetensors import safe_open
            self.context = safe_open(self.file, framework="pt", device=str(self.device))
            self.handle = self.context.__enter__()
        return self.handle

    def touched(self, nbytes: int) -> None:
        """Count the bytes of the mapping a read touched."""
        self.bytes += nbytes
        if self.bytes >= self.REOPEN_BYTES:
            self.close()

    def close(self) -> None:
        if self.context is not None:
            self.context.__exit__(None, None, None)
        self.handle, self.context, self.bytes = None, None, 0


def _private(tensor: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
    """`tensor`, cloned when it views the file mapping `read` came from."""
    same = tensor.untyped_storage().data_ptr() == read.untyped_storage().data_ptr()
    return tensor.clone() if same and tensor.device.type == "cpu" else tensor


def _read_rows(handle, source: Source, piece) -> Optional[torch.Tensor]:
    """This rank's slice read alone from the file, or None when the transform is not a row selection."""
    from ..sharding.streaming import _source_rows
    sliced = handle.get_slice(source.key)
    shape = tuple(sliced.get_shape())
    full = piece.full_shape
    rows = _source_rows(shape, full, source.transform)
    if rows is None:
        return None
    dim = min(piece.dim, len(full) - 1)
    wanted = torch.cat([rows[start:stop] for start, stop in piece.ranges]) if dim == 0 else rows
    columns = [slice(start, stop) for start, stop in piece.ranges] if dim == 1 else [slice(None)]
    parts = []
    for run in _runs(wanted.tolist()):
        parts.append(torch.cat([sliced[(run, *([column] if len(shape) > 1 else []))] for column in columns],
                               dim=1) if dim == 1 else sliced[run])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _runs(rows: list[int]) -> list[slice]:
    """Consecutive rows as slices (a row permutation reads one run at a time)."""
    runs, begin = [], 0
    for position in range(1, len(rows) + 1):
        if position == len(rows) or rows[position] != rows[position - 1] + 1:
            runs.append(slice(rows[begin], rows[position - 1] + 1))
            begin = position
    return runs


def _assign(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, attribute = name.rpartition(".")
    module = model.get_submodule(module_name)
    if tuple(module._parameters[attribute].shape) != tuple(value.shape):
        raise ValueError(f"tensor-parallel loading: {name} read as {tuple(value.shape)}, the split model holds "
                         f"{tuple(module._parameters[attribute].shape)}")
    module._parameters[attribute] = torch.nn.Parameter(value, requires_grad=False)
