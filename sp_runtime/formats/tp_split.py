"""Tensor-parallel slices of a quantized weight that keep its structure: output rows (column-parallel) take their
rows of every row part (codes, per-row and per-block scales, GGUF blocks) and keep the per-tensor constants; input
columns (row-parallel) take whole groups only (convrot rotation groups, mxfp8 / nvfp4 scale blocks, GGUF blocks),
per-row and per-tensor scales whole. A cut inside a group is refused naming the numbers."""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch

from .weights import QuantWeight


def split_quant(weight: QuantWeight, dim: int, ranges: Sequence[tuple[int, int]], where: str) -> QuantWeight:
    """`weight`'s rows (dim 0) or input columns (dim 1) in `ranges` of the full axis, concatenated."""
    if dim == 0:
        rows = {name: _take(part, 0, ranges) for name, part in weight.rows.items()}
        count = sum(stop - start for start, stop in ranges)
        return replace(weight, rows=rows, shape=(count, *weight.shape[1:]))
    unit, parts = _column_layout(weight)
    for start, stop in ranges:
        if start % unit or stop % unit:
            raise ValueError(f"{where}: its {_describe(weight)} groups of {unit} "
                             f"input features would be cut at {start if start % unit else stop} (of "
                             f"{weight.shape[1]}); use a degree whose slices are multiples of {unit}, or a float file")
    rows = dict(weight.rows)
    for name, per_unit in parts.items():  # part -> its columns per `unit` input features (a fraction for packed)
        part = weight.rows[name]
        rows[name] = _take(part, 1, [(int(start * per_unit), int(stop * per_unit)) for start, stop in ranges])
    count = sum(stop - start for start, stop in ranges)
    return replace(weight, rows=rows, shape=(weight.shape[0], count))


def _column_layout(weight: QuantWeight) -> tuple[int, dict[str, float]]:
    """(the input features a column cut must fall on multiples of, {row part: its columns per input feature})."""
    if weight.format == "scaled":
        return weight.params.get("group") or 1, {"codes": 1.0}  # a per-row scale [rows, 1] stays whole
    if weight.format == "mxfp8":
        return 32, {"codes": 1.0, "scale": 1 / 32}
    if weight.format == "nvfp4":
        return 16, {"codes": 0.5, "scale": 1 / 16}
    if weight.format == "gguf":
        import gguf
        block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[weight.params["type"]]]
        return block_size, {"blocks": type_size / block_size}
    raise ValueError(f"tensor parallelism cannot split a {weight.format} weight along its input features (no "
                     f"column layout known for it)")


def _describe(weight: QuantWeight) -> str:
    if weight.format == "gguf":
        return f"GGUF {weight.params['type']}"
    if weight.format == "scaled":
        return "convrot rotation" if weight.params.get("group") else "scaled"
    return weight.format


def _take(part: torch.Tensor, dim: int, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    pieces = [part.narrow(dim, start, stop - start) for start, stop in ranges]
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)).clone()
