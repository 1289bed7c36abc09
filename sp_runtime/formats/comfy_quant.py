"""ComfyUI's quantized safetensors: legacy "scaled fp8" files and mixed-precision (`comfy_quant`) files.

On-disk layouts (ComfyUI comfy/utils.py convert_old_quants, comfy/quant_ops.py, comfy_kitchen's layouts), for a
layer `L` (keys carry the file's prefix, e.g. `model.diffusion_model.`):
- legacy scaled fp8: a marker tensor `scaled_fp8`; per layer `L.weight` fp8 and `L.scale_weight` (fp32, one value or
  one per row), optional `L.scale_input`. W = q x scale.
- mixed precision: per layer `L.comfy_quant` (uint8 bytes of JSON, e.g. {"format": "float8_e4m3fn"}) or the file
  metadata `_quantization_metadata` = {"format_version": "1.0", "layers": {L: {...}}}. Formats:
  float8_e4m3fn / float8_e5m2 (`L.weight_scale` per tensor, optional `L.input_scale`); int8_tensorwise (`L.weight`
  int8 [N, K], `L.weight_scale` one value or [N, 1]; with "convrot": true the rows were rotated by a regular
  Hadamard matrix per group of "convrot_groupsize" input features); mxfp8 (e4m3 codes, e8m0 scales per 32 inputs in
  cuBLAS's swizzled 128x4 layout); nvfp4 (e2m1 codes, two per byte with the even element in the HIGH nibble, e4m3
  scales per 16 inputs swizzled, `L.weight_scale_2` per tensor). mxfp8 / nvfp4 storage is padded to 32 / 16.
Input scales (legacy `L.scale_input`, else `L.input_scale`) are kept for the fp8 / nvfp4 activation kernels
(formats.kernels); a legacy marker of two values, or an entry's "full_precision_matrix_mult", asks for matmuls in the
compute dtype, as ComfyUI reads them. Layers without an entry are plain tensors in the file's float dtype.
"""
from __future__ import annotations

import json
import math
from typing import Optional

import torch

from .weights import DEQUANTIZERS, QuantWeight

LEGACY_MARKER = "scaled_fp8"
METADATA_KEY = "_quantization_metadata"
LAYER_SUFFIX = ".comfy_quant"
SUPPORTED = ("float8_e4m3fn", "float8_e5m2", "int8_tensorwise", "mxfp8", "nvfp4")
# per format: (suffix -> part name) of the tensors that make a layer's weight, besides `.weight`
SCALE_KEYS = {"legacy": {".scale_weight": "scale"}, "nvfp4": {".weight_scale": "scale", ".weight_scale_2": "scale_2"}}
DEFAULT_SCALE_KEYS = {".weight_scale": "scale"}
IGNORED_SUFFIXES = (".scale_input", ".input_scale", LAYER_SUFFIX)  # read for the kernels only (INPUT_SCALE_KEYS)
# per format: where a layer's activation scale is (one value), for the fp8 / nvfp4 kernels
INPUT_SCALE_KEYS = {"legacy": (".scale_input",), "float8_e4m3fn": (".input_scale",), "float8_e5m2": (".input_scale",),
                    "nvfp4": (".input_scale",)}
AUXILIARY_SUFFIXES = (".scale_weight", ".weight_scale", ".weight_scale_2", *IGNORED_SUFFIXES, LEGACY_MARKER)
FP8_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
NVFP4_BLOCK, MXFP8_BLOCK = 16, 32
REGULAR_HADAMARD_4 = ((1, 1, 1, -1), (1, 1, -1, 1), (1, -1, 1, 1), (-1, 1, 1, 1))
DEFAULT_CONVROT_GROUP = 256
CONVROT_GROUPS = (4, 16, 64, 256, 1024, 4096)  # powers of 4; the rotation is a group x group matrix per call
MAX_LAYER_JSON_BYTES = 4096  # a `.comfy_quant` entry: ComfyUI writes a few dozen bytes


# ---------------------------------------------------------------------------------------------------------------
# Detection: layer -> its quantization entry

def layer_entries(path: str, tensors: dict, metadata: dict, prefix: str, read_small) -> Optional[dict[str, dict]]:
    """Layer name (prefix stripped) -> {"format": ..., ...} of a ComfyUI quantized file; None for other files.

    read_small(keys) -> {key: tensor} reads small tensors (the JSON bytes of `.comfy_quant` entries), each checked
    against MAX_LAYER_JSON_BYTES in the header first. Every entry is checked (check_entry); errors name the file and
    the layer. A `scaled_fp8` marker without any `.scale_weight` layer quantizes nothing, as in ComfyUI's
    comfy/utils.py convert_old_quants: the file is a plain one (None)."""
    if prefix + LEGACY_MARKER in tensors:
        full = math.prod(tensors[prefix + LEGACY_MARKER][1]) == 2  # ComfyUI: full_precision_matrix_mult
        entry = {"format": "legacy", **({"full_precision_matrix_mult": True} if full else {})}
        layers = {key[len(prefix):-len(".scale_weight")]: dict(entry)
                  for key in tensors if key.startswith(prefix) and key.endswith(".scale_weight")}
        return layers or None
    if METADATA_KEY in metadata:
        layers = _parse_json(path, f"metadata {METADATA_KEY!r}", metadata[METADATA_KEY].encode("utf-8"))
        layers = layers.get("layers", {}) if isinstance(layers, dict) else None
        if not isinstance(layers, dict):
            raise ValueError(f"{path!r}: metadata {METADATA_KEY!r} has no 'layers' object (layer -> entry); "
                             f"download the file again")
        entries = {name[len(prefix):]: entry for name, entry in layers.items() if name.startswith(prefix)}
    else:
        keys = [key for key in tensors if key.startswith(prefix) and key.endswith(LAYER_SUFFIX)]
        if not keys:
            return None
        for key in keys:
            dtype, shape = tensors[key]
            if dtype != "U8" or len(shape) != 1 or shape[0] > MAX_LAYER_JSON_BYTES:
                raise ValueError(f"{path!r}: {key!r} is {dtype} {list(shape)}, not the bytes of a JSON entry of at "
                                 f"most {MAX_LAYER_JSON_BYTES} bytes (U8 [n])")
        entries = {key[len(prefix):-len(LAYER_SUFFIX)]: _parse_json(path, repr(key), value.numpy().tobytes())
                   for key, value in read_small(keys).items()}
    for layer, entry in entries.items():
        check_entry(path, layer, entry)
    return entries


def _parse_json(path: str, field: str, data: bytes):
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise ValueError(f"{path!r}: {field} is not valid JSON ({type(error).__name__}: {error}); download the "
                         f"file again") from None


def check_entry(path: str, layer: str, entry) -> None:
    """A clear error for entries that are malformed or name formats / rotations we cannot dequantize."""
    name = entry.get("format") if isinstance(entry, dict) else None
    if not isinstance(entry, dict) or not isinstance(name, str):
        raise ValueError(f"{path!r}: the quantization entry of layer {layer!r} is {str(entry)[:80]!r}, not an "
                         f"object with a 'format'; download the file again")
    if name != "legacy" and name not in SUPPORTED:
        raise ValueError(f"{path!r}: layer {layer!r} is quantized as {name!r}, which is not supported; supported "
                         f"ComfyUI formats: scaled fp8, {', '.join(SUPPORTED)}")
    if entry.get("convrot"):
        group = entry.get("convrot_groupsize", DEFAULT_CONVROT_GROUP)
        if isinstance(group, bool) or not isinstance(group, (int, str)) or str(group) not in map(str, CONVROT_GROUPS):
            raise ValueError(f"{path!r}: layer {layer!r} has convrot_groupsize {group!r}; a convrot group is a "
                             f"power of 4 from {CONVROT_GROUPS[0]} to {CONVROT_GROUPS[-1]} (ComfyUI writes "
                             f"{DEFAULT_CONVROT_GROUP})")


def auxiliary_keys(layer: str, entry: dict) -> list[str]:
    """The keys (prefix stripped) of a layer that are not model weights: scales and markers."""
    suffixes = (*SCALE_KEYS.get(entry["format"], DEFAULT_SCALE_KEYS), *IGNORED_SUFFIXES)
    return [layer + suffix for suffix in suffixes]


def describe(entry: dict) -> str:
    name = "scaled fp8" if entry["format"] == "legacy" else entry["format"]
    return f"{name} convrot" if entry.get("convrot") else name


# ---------------------------------------------------------------------------------------------------------------
# Reading one layer's weight

def read_weight(handle, full_prefix: str, entry: dict, available: set) -> QuantWeight:
    """The QuantWeight of layer `full_prefix` (its full key stem) from an open safetensors file holding the keys
    `available`."""
    data = handle.get_tensor(full_prefix + ".weight")
    parts = {part: handle.get_tensor(full_prefix + suffix)
             for suffix, part in SCALE_KEYS.get(entry["format"], DEFAULT_SCALE_KEYS).items()
             if full_prefix + suffix in available}
    kind = entry["format"]
    if kind == "nvfp4":
        weight = _nvfp4(data, parts)
    elif kind == "mxfp8":
        weight = _mxfp8(data, parts)
    else:
        scale = parts.get("scale", torch.ones((), device=data.device)).float()
        group = int(entry.get("convrot_groupsize", DEFAULT_CONVROT_GROUP)) if entry.get("convrot") else 0
        weight = scaled_weight(data, scale, group)
    input_scale = next((full_prefix + suffix for suffix in INPUT_SCALE_KEYS.get(kind, ())
                        if full_prefix + suffix in available), None)
    if input_scale is not None and math.prod(handle.get_slice(input_scale).get_shape()) == 1:  # else read past
        value = handle.get_tensor(input_scale).float().reshape(())
        if value.item() != 1.0:  # 1 is the kernels' default (ComfyUI drops it too)
            weight.consts["input_scale"] = value
    if entry.get("full_precision_matrix_mult"):
        weight.params["full_precision"] = True
    return weight


def scaled_weight(codes: torch.Tensor, scale: torch.Tensor, rotation_group: int = 0) -> QuantWeight:
    """W = codes x scale (one value, or one per row), then the inverse group rotation when rotation_group > 0."""
    rows, cols = codes.shape
    if rotation_group and cols % rotation_group:
        raise ValueError(f"a convrot weight with {cols} input features does not split into groups of "
                         f"{rotation_group}: the file's convrot_groupsize does not fit the layer")
    if scale.numel() == rows and rows > 1:
        return QuantWeight("scaled", tuple(codes.shape), {"codes": codes, "scale": scale.reshape(rows, 1)},
                           params={"group": rotation_group})
    if scale.numel() != 1:
        raise ValueError(f"a weight scale of shape {list(scale.shape)} does not fit a weight of shape "
                         f"{list(codes.shape)}: one value or one per row expected")
    return QuantWeight("scaled", tuple(codes.shape), {"codes": codes}, {"scale": scale.reshape(())},
                       {"group": rotation_group})


def _mxfp8(codes: torch.Tensor, parts: dict) -> QuantWeight:
    rows, cols = codes.shape
    scales = unswizzle(parts["scale"].view(torch.uint8), rows, cols // MXFP8_BLOCK)
    return QuantWeight("mxfp8", (rows, cols), {"codes": codes, "scale": scales})


def _nvfp4(packed: torch.Tensor, parts: dict) -> QuantWeight:
    rows, cols = packed.shape[0], packed.shape[1] * 2
    scales = unswizzle(parts["scale"].view(torch.float8_e4m3fn), rows, cols // NVFP4_BLOCK)
    return QuantWeight("nvfp4", (rows, cols), {"codes": packed.view(torch.uint8), "scale": scales},
                       {"scale_2": parts["scale_2"].float().reshape(())})


def unswizzle(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[rows, cols] block scales from cuBLAS's 128x4-tile layout: element (r, c) of tile (i, j) sits at flat index
    ((i * tiles_across + j) * 32 + r % 32) * 16 + (r // 32 % 4) * 4 + c % 4."""
    down, across = -(-rows // 128), -(-cols // 4)
    tiles = swizzled.reshape(down, across, 32, 4, 4)
    plain = tiles.permute(0, 3, 2, 1, 4).reshape(down * 128, across * 4)
    return plain[:rows, :cols].contiguous()


# ---------------------------------------------------------------------------------------------------------------
# Dequantizers

def _dequantize_scaled(weight: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    scale = weight.rows.get("scale", weight.consts.get("scale"))
    values = weight.rows["codes"].to(torch.float32) * scale
    group = weight.params.get("group", 0)
    if group:
        rows, cols = values.shape
        values = (values.reshape(rows, cols // group, group) @ regular_hadamard(group, values.device)).reshape(
            rows, cols)
    return values.to(dtype)


def regular_hadamard(size: int, device) -> torch.Tensor:
    """The symmetric orthogonal rotation ComfyUI's convrot uses: Kronecker powers of the 4x4 regular Hadamard
    matrix, scaled by 1 / sqrt(size); it is its own inverse."""
    base = torch.tensor(REGULAR_HADAMARD_4, dtype=torch.float64)
    matrix = base
    while matrix.shape[0] < size:
        matrix = torch.kron(matrix, base)
    if matrix.shape[0] != size:
        raise ValueError(f"convrot group size {size} is not a power of 4")
    return (matrix / size ** 0.5).to(device, torch.float32)


def _dequantize_mxfp8(weight: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    codes = weight.rows["codes"]
    rows, cols = codes.shape
    scale = torch.exp2(weight.rows["scale"].to(torch.float32) - 127)  # e8m0: a power of two, bias 127
    values = codes.to(torch.float32).reshape(rows, -1, MXFP8_BLOCK) * scale[..., None]
    return values.reshape(rows, cols)[:, :weight.shape[1]].to(dtype)


def _dequantize_nvfp4(weight: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    packed = weight.rows["codes"]
    table = torch.tensor(E2M1_VALUES, device=packed.device)
    codes = torch.stack([packed >> 4, packed & 0x0F], dim=-1).reshape(packed.shape[0], -1)  # even element high
    values = table[codes.long()].reshape(packed.shape[0], -1, NVFP4_BLOCK)
    values = values * (weight.rows["scale"].to(torch.float32) * weight.consts["scale_2"])[..., None]
    return values.reshape(packed.shape[0], -1)[:, :weight.shape[1]].to(dtype)


DEQUANTIZERS.update(scaled=_dequantize_scaled, mxfp8=_dequantize_mxfp8, nvfp4=_dequantize_nvfp4)
