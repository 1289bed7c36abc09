"""Writers of tiny quantized checkpoints in the real on-disk layouts, for the format tests: ComfyUI legacy scaled
fp8, ComfyUI mixed precision (per-layer `.comfy_quant` tensors or `_quantization_metadata`), and GGUF through the
`gguf` package's own writer and quantizers. Each writer also returns the float32 weights the file encodes,
computed here from the codes it wrote (GGUF: by gguf's numpy dequantizer), independently of sp_runtime.formats.

Like released files, only the transformer blocks' Linear weights are quantized (and those of Wan S2V's and Animate's
extra modules: audio encoder and injector, face encoder, motion encoder); other weights stay bf16 (ComfyUI) or
F16 / F32 (GGUF).
"""
from __future__ import annotations

import json
import math

import numpy as np
import torch
from safetensors.torch import save_file

from . import build_tiny_model, original_state_dict

COMFY_FORMATS = ("scaled_fp8", "comfy_quant", "quant_metadata")
FORMATS = COMFY_FORMATS + ("gguf",)
GGUF_ARCHITECTURES = {"flux": "flux", "qwen_image": "qwen_image", "wan": "wan", "z_image": "lumina2"}
# the mixed-precision file cycles through these per layer (those whose shape allows them)
MIXED = ({"format": "float8_e4m3fn"}, {"format": "int8_tensorwise", "convrot": True}, {"format": "mxfp8"},
         {"format": "nvfp4"}, {"format": "float8_e5m2"}, {"format": "int8_tensorwise"})
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def write_quantized(family: str, path: str, reference_path: str, fmt: str, seed: int = 0, prefix: str = "",
                    metadata: dict | None = None, only: str | None = None, **size) -> dict[str, str]:
    """Write a tiny `family` model quantized in `fmt` to `path` and the float32 weights it encodes (original key
    layout) to `reference_path`; returns {quantized key (prefix stripped): what it was quantized as}.

    only: one quant type for every layer that fits it: a comfy_quant format ("nvfp4", "int8_tensorwise convrot")
    or a GGUF type ("Q4_K"); default: a mix of them all."""
    state = {k: v.contiguous() for k, v in original_state_dict(family, build_tiny_model(family, seed, **size)).items()}
    if fmt == "gguf":
        reference, kinds = _write_gguf(state, path, GGUF_ARCHITECTURES[family], only)
    else:
        reference, kinds = _write_comfy(state, path, fmt, prefix, metadata or {}, only)
    save_file(reference, reference_path, metadata=metadata)
    return kinds


WAN_VARIANT_MODULES = ("casual_audio_encoder.", "audio_injector.", "face_encoder.", "motion_encoder.")
Z_IMAGE_BLOCKS = ("layers.", "noise_refiner.", "context_refiner.")
DECODER_LAYERS = ("language_model.layers.",)  # HiDream-O1's blocks


def _quantizable(key: str, tensor: torch.Tensor) -> bool:
    return (("blocks." in key or key.startswith(WAN_VARIANT_MODULES + Z_IMAGE_BLOCKS + DECODER_LAYERS))
            and key.endswith(".weight")
            and tensor.dim() == 2)


# ---------------------------------------------------------------------------------------------------------------
# ComfyUI formats

def _write_comfy(state: dict, path: str, fmt: str, prefix: str, metadata: dict, only: str | None):
    out, reference, entries = {}, {}, {}
    layers = [key for key, tensor in state.items() if _quantizable(key, tensor)]
    for key, tensor in state.items():
        if key not in layers:
            out[prefix + key] = tensor.to(torch.bfloat16)
            reference[key] = out[prefix + key].float()
            continue
        layer = key[: -len(".weight")]
        if fmt == "scaled_fp8":
            entry = {"format": "legacy", "per_row": layers.index(key) % 2 == 1}
        elif fmt == "quant_metadata":
            entry = _convrot_entry(tensor) or {"format": "int8_tensorwise"}
        else:
            entry = _mixed_entry(tensor, layers.index(key), only)
        parts, reference[key] = _quantize(tensor, entry)
        out.update({prefix + layer + suffix: part for suffix, part in parts.items()})
        entries[layer] = {k: v for k, v in entry.items() if k != "per_row"}
    if fmt == "scaled_fp8":
        out[prefix + "scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    elif fmt == "quant_metadata":
        metadata = {**metadata, "_quantization_metadata": json.dumps(
            {"format_version": "1.0", "layers": {prefix + layer: entry for layer, entry in entries.items()}})}
    else:
        for layer, entry in entries.items():
            out[f"{prefix}{layer}.comfy_quant"] = torch.tensor(list(json.dumps(entry).encode()), dtype=torch.uint8)
    save_file(out, path, metadata=metadata or None)
    return reference, {f"{layer}.weight": _name(entry) for layer, entry in entries.items()}


def _name(entry: dict) -> str:
    return entry["format"] + (" convrot" if entry.get("convrot") else "")


def _mixed_entry(tensor: torch.Tensor, index: int, only: str | None) -> dict:
    """The format of the index-th quantized layer: `only`, or the mix in turn; float8 where the shape does not fit
    the block size."""
    turn = index % len(MIXED)
    order = [entry for entry in MIXED if _name(entry) == only] if only else MIXED[turn:] + MIXED[:turn]
    for choice in (*order, MIXED[0]):
        entry = _convrot_entry(tensor) if choice.get("convrot") else dict(choice)
        block = {"mxfp8": 32, "nvfp4": 16}.get(choice["format"], 1)
        if entry and tensor.shape[0] % block == 0 and tensor.shape[1] % block == 0:
            return entry
    raise AssertionError("float8 always fits")


def _convrot_entry(tensor: torch.Tensor, limit: int = 256) -> dict | None:
    """int8 with the rotation by the largest power-of-4 Hadamard block (up to limit) that divides the width; None
    when 4 does not divide it (Z-Image's tiny feed-forward is 1706 wide)."""
    group = 1
    while tensor.shape[1] % (group * 4) == 0 and group * 4 <= limit:
        group *= 4
    return {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": group} if group > 1 else None


def _quantize(w: torch.Tensor, entry: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(suffix -> stored tensor, float32 weight the codes encode)."""
    kind = entry["format"]
    if kind == "legacy":
        q, scale, value = _fp8(w, torch.float8_e4m3fn, entry["per_row"])
        return {".weight": q, ".scale_weight": scale, ".scale_input": torch.ones(())}, value
    if kind.startswith("float8"):
        q, scale, value = _fp8(w, getattr(torch, kind), per_row=False)
        return {".weight": q, ".weight_scale": scale, ".input_scale": torch.ones(())}, value
    if kind == "int8_tensorwise":
        return _int8(w, entry.get("convrot_groupsize", 0) if entry.get("convrot") else 0)
    if kind == "mxfp8":
        return _mxfp8(w)
    return _nvfp4(w)


def _fp8(w, dtype, per_row: bool):
    amax = w.abs().amax(dim=1, keepdim=True) if per_row else w.abs().amax()
    scale = (amax / torch.finfo(dtype).max).float()
    q = (w / scale).to(dtype)
    return q, scale.reshape(-1) if per_row else scale, q.float() * scale


def _regular_hadamard(size: int) -> torch.Tensor:
    base = torch.tensor([[1.0, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=torch.float64)
    matrix = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(round(math.log(size, 4))):
        matrix = torch.kron(matrix, base)
    return (matrix / math.sqrt(size)).float()


def _rotate(w: torch.Tensor, group: int) -> torch.Tensor:
    if not group:
        return w
    rows, cols = w.shape
    return (w.reshape(rows, cols // group, group) @ _regular_hadamard(group)).reshape(rows, cols)


def _int8(w, group: int):
    rotated = _rotate(w, group)
    scale = rotated.abs().amax(dim=1, keepdim=True) / 127 if group else rotated.abs().amax() / 127
    q = (rotated / scale).round().clamp(-127, 127).to(torch.int8)
    return {".weight": q, ".weight_scale": scale.float()}, _rotate(q.float() * scale, group)


def _swizzle(scales: torch.Tensor) -> torch.Tensor:
    """cuBLAS's 128x4-tile block-scale layout (the inverse of what the loader undoes), 2-D [rows', cols']."""
    rows, cols = scales.shape
    down, across = -(-rows // 128), -(-cols // 4)
    padded = torch.zeros(down * 128, across * 4, dtype=scales.dtype)
    padded[:rows, :cols] = scales
    tiles = padded.reshape(down, 4, 32, across, 4).permute(0, 3, 2, 1, 4)  # (tile row, tile col, r % 32, r // 32, c)
    return tiles.reshape(down * 128, across * 4)


def _mxfp8(w):
    rows, cols = w.shape
    blocks = w.reshape(rows, cols // 32, 32)
    exponent = torch.ceil(torch.log2(blocks.abs().amax(-1).clamp_min(2.0 ** -120) / 448)) + 127
    scale = torch.exp2(exponent - 127)
    q = (blocks / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    stored = _swizzle(exponent.to(torch.uint8)).view(torch.float8_e8m0fnu)
    return {".weight": q.reshape(rows, cols), ".weight_scale": stored}, (q.float() * scale[..., None]).reshape(rows,
                                                                                                              cols)


def _nvfp4(w):
    rows, cols = w.shape
    scale_2 = w.abs().amax() / (448 * 6)
    blocks = w.reshape(rows, cols // 16, 16)
    block_scale = (blocks.abs().amax(-1) / 6 / scale_2).to(torch.float8_e4m3fn)
    total = scale_2 * block_scale.float()
    x = blocks / torch.where(total == 0, 1, total)[..., None]
    index = (x.abs()[..., None] - E2M1[:8]).abs().argmin(-1)
    codes = index + 8 * (x < 0)
    value = (E2M1[index] * torch.where(x < 0, -1.0, 1.0) * total[..., None]).reshape(rows, cols)
    codes = codes.reshape(rows, cols).to(torch.uint8)
    packed = (codes[:, 0::2] << 4) | codes[:, 1::2]  # the even element in the high nibble
    return {".weight": packed, ".weight_scale": _swizzle(block_scale.view(torch.uint8)).view(torch.float8_e4m3fn),
            ".weight_scale_2": scale_2.float()}, value


# ---------------------------------------------------------------------------------------------------------------
# GGUF

LEGACY_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# K-quant block: (byte offset of d, offset of dmin or None, the largest |code x sub-scale| d multiplies)
K_SCALE_FIELDS = {"Q2_K": (80, 82, 45), "Q3_K": (108, None, 128), "Q4_K": (0, 2, 945), "Q5_K": (0, 2, 1953),
                  "Q6_K": (208, None, 4096)}


def _write_gguf(state: dict, path: str, architecture: str, only: str | None):
    import gguf
    writer = gguf.GGUFWriter(path, architecture)
    reference, kinds = {}, {}
    rng = np.random.default_rng(0)
    for key, tensor in state.items():
        array = tensor.numpy()
        kind = _gguf_type(tensor.shape[1], kinds, only) if _quantizable(key, tensor) else None
        if kind is not None:
            kinds[key] = kind
            qtype = gguf.GGMLQuantizationType[kind]
            raw = (_random_k_blocks(tensor.shape, kind, rng) if kind in K_TYPES else gguf.quants.quantize(array, qtype))
            writer.add_tensor(key, raw, raw_shape=raw.shape, raw_dtype=qtype)
            reference[key] = torch.from_numpy(gguf.quants.dequantize(raw, qtype).copy()).reshape(tensor.shape)
        elif tensor.dim() > 3:  # as ComfyUI-GGUF stores 5-D convolutions: reshaped, the shape in metadata
            flat = array.reshape(array.shape[0], -1).astype(np.float16)
            writer.add_tensor(key, flat)
            writer.add_array(f"comfy.gguf.orig_shape.{key}", list(tensor.shape))
            reference[key] = torch.from_numpy(flat.astype(np.float32)).reshape(tensor.shape)
        else:
            stored = array.astype(np.float16 if tensor.dim() == 2 else np.float32)
            writer.add_tensor(key, stored)
            reference[key] = torch.from_numpy(stored.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference, kinds


def _gguf_type(cols: int, chosen: dict, only: str | None):
    """Layers 256 wide get the K-quants in turn, other layers Q8_0 / Q4_0 / ... in turn; None: F16."""
    if only is not None:
        return only if cols % (256 if only in K_TYPES else 32) == 0 else None
    if cols % 256 == 0:
        return K_TYPES[sum(kind in K_TYPES for kind in chosen.values()) % len(K_TYPES)]
    return LEGACY_TYPES[sum(kind in LEGACY_TYPES for kind in chosen.values()) % len(LEGACY_TYPES)] \
        if cols % 32 == 0 else None


def _random_k_blocks(shape, kind: str, rng) -> np.ndarray:
    """gguf has no K-quant quantizer: random codes and sub-scales, with d (and dmin) set so that weights are about
    1 / sqrt(cols) in size. The file's weights are whatever these blocks decode to (gguf's numpy reference)."""
    import gguf
    rows, cols = shape
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    d_at, dmin_at, largest = K_SCALE_FIELDS[kind]
    d = np.float16(2.0 / math.sqrt(cols) / largest)
    raw[..., d_at:d_at + 2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
    if dmin_at is not None:
        dmin = np.float16(1.0 / math.sqrt(cols) / 63)
        raw[..., dmin_at:dmin_at + 2] = np.frombuffer(dmin.tobytes(), dtype=np.uint8)
    return raw.reshape(rows, -1)
