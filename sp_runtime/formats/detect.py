"""Which quantized format a checkpoint uses, from its header (plus ComfyUI's few bytes of per-layer JSON), and which
of its keys are quantized weights or only scales and markers."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional


from . import comfy_quant, gguf_file

CONTAINER_KEY = "ulysses_sp.container"  # Header.metadata entry set for GGUF files ("gguf")


@dataclass(frozen=True)
class Quantization:
    """A quantized checkpoint: `layers` maps a quantized weight's key (prefix stripped) to its entry."""

    kind: str                        # "scaled_fp8", "comfy_quant" or "gguf"
    layers: dict[str, dict]
    auxiliary: frozenset[str]        # keys (prefix stripped) that are scales or markers, not model weights

    def summary(self) -> str:
        """e.g. "gguf (Q4_K x 120, Q6_K x 8)"."""
        counts = Counter(_describe(entry) for entry in self.layers.values())
        return f"{self.kind} ({', '.join(f'{name} x {count}' for name, count in sorted(counts.items()))})"


def _describe(entry: dict) -> str:
    return entry["type"] if entry["format"] == "gguf" else comfy_quant.describe(entry)


def quantization(header, prefix: str = "") -> Optional[Quantization]:
    """The quantization of a checkpoint header (a checkpoints.header.Header), or None for plain float files.

    Besides the header, only ComfyUI's per-layer `.comfy_quant` JSON bytes are read (the file opened once).
    Raises ValueError naming formats or quant types that cannot be dequantized."""
    if header.metadata.get(CONTAINER_KEY) == "gguf":
        gguf_file.check_types(header.path, header.tensors)
        layers = {key[len(prefix):]: {"format": "gguf", "type": kind} for key, (kind, _) in header.tensors.items()
                  if key.startswith(prefix) and kind not in gguf_file.PLAIN_TYPES}
        return Quantization("gguf", layers, frozenset()) if layers else None
    entries = comfy_quant.layer_entries(header.path, header.tensors, header.metadata, prefix,
                                        _small_reader(getattr(header, "files", ()) or (header.path,)))
    if entries is None:
        return None
    layers, auxiliary = {}, set()
    for layer, entry in entries.items():
        layers[f"{layer}.weight"] = entry
        auxiliary.update(comfy_quant.auxiliary_keys(layer, entry))
    kind = "scaled_fp8" if comfy_quant.LEGACY_MARKER in (k[len(prefix):] for k in header.tensors) else "comfy_quant"
    auxiliary.add(comfy_quant.LEGACY_MARKER)
    return Quantization(kind, layers, frozenset(auxiliary))


def _small_reader(files) -> Callable[[list], dict]:
    def read(keys: list) -> dict:
        from safetensors import safe_open
        found = {}
        for file in files:  # a folder's shards: each key from the shard that holds it
            with safe_open(file, framework="pt", device="cpu") as handle:
                found.update({key: handle.get_tensor(key) for key in set(keys) & set(handle.keys())})
        return found
    return read


def plain_view(header):
    """The header as a plain float file would show it, for the model families' detectors: scales and markers
    dropped, packed nvfp4 weights at their logical width. Raises ValueError for unsupported quant formats."""
    from dataclasses import replace
    if header.metadata.get(CONTAINER_KEY) == "gguf":
        return header
    marker = next((key for key in header.tensors if key.endswith(comfy_quant.LEGACY_MARKER)), "")
    prefix = marker[: -len(comfy_quant.LEGACY_MARKER)] if marker else ""  # layer names below carry no prefix
    quant = quantization(header, prefix)
    if quant is None:
        return header
    tensors = {}
    for key, (dtype, shape) in header.tensors.items():
        name = key[len(prefix):] if key.startswith(prefix) else key
        if name in quant.auxiliary or key.endswith(comfy_quant.AUXILIARY_SUFFIXES):
            continue
        if quant.layers.get(name, {}).get("format") == "nvfp4":
            shape = (shape[0], shape[1] * 2)
        tensors[key] = (dtype, shape)
    return replace(header, tensors=tensors)
