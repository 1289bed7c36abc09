"""Which matmul a quantized Linear (weights.QuantLinear) uses, chosen once per layer format and device at load:
comfy-kitchen's low-precision kernels when it imports in the workers' Python, torch's fp8 scaled matmul, or
dequantize-then-matmul. Activations are handled as ComfyUI's own mixed-precision Linear does per format
(comfy/ops.py, comfy/quant_ops.py): fp8 inputs quantized per tensor with the file's input scale (1 without one),
int8 inputs per row (rotated first for convrot), mxfp8 / nvfp4 inputs in blocks of 32 / 16.

The load option `quant_kernels` (default: the environment's ULYSSES_SP_QUANT_KERNELS, else "auto"): "auto" (the
kernels ComfyUI itself uses on the device), "dequantize" (none), "all" (every kernel whose ops run on the device, CPU
included: what ComfyUI does with --supports-fp8-compute; for parity tests).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Optional

import torch

log = logging.getLogger(__name__)
MODE_ENV = "ULYSSES_SP_QUANT_KERNELS"
MODES = ("auto", "dequantize", "all")
DEQUANTIZE = "dequantize"
FP8_TORCH = "fp8 scaled_mm (torch)"
INT8_KITCHEN = "int8 (comfy-kitchen)"
MXFP8_KITCHEN = "mxfp8 (comfy-kitchen)"
NVFP4_KITCHEN = "nvfp4 (comfy-kitchen)"
F8_E4M3_MAX, F4_E2M1_MAX = 448.0, 6.0


@dataclass(frozen=True)
class Choice:
    """A layer's matmul: `path` (one of the names above), `why` it fell back (empty on a kernel), the function
    run(module, x, bias) -> output, None for dequantize-then-matmul."""

    path: str
    why: str = ""
    run: Optional[Callable] = None

    def label(self) -> str:
        return f"{self.path} ({self.why})" if self.why else self.path


def mode(option=None) -> str:
    """The kernel mode of a load: its `quant_kernels` option, else the environment's, else "auto"."""
    if option is not None:
        if option not in MODES:
            raise ValueError(f"load option quant_kernels must be one of {', '.join(MODES)}, got {str(option)[:40]!r}")
        return option
    value = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{MODE_ENV}={value[:40]!r}: expected one of {', '.join(MODES)}")
    return value


@lru_cache(maxsize=1)
def kitchen():
    """(comfy_kitchen module or None, why not). Its backends set as ComfyUI sets them: the CUDA backend only with a
    CUDA 13 torch, no Triton backend."""
    try:
        import comfy_kitchen
    except Exception as error:  # absent, or a wheel that does not load beside this torch
        return None, f"comfy-kitchen not importable ({type(error).__name__})"
    cuda = torch.version.cuda
    if cuda is None or tuple(int(part) for part in str(cuda).split(".")[:1]) < (13,):
        comfy_kitchen.registry.disable("cuda")
    comfy_kitchen.registry.disable("triton")
    return comfy_kitchen, ""


def capability(device: torch.device) -> Optional[tuple[int, int]]:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def choose(weight, device: torch.device, chosen_mode: str = "auto") -> Choice:
    """The matmul for one QuantWeight on `device` in mode `chosen_mode` (one of MODES)."""
    if chosen_mode == "dequantize":
        return Choice(DEQUANTIZE, "quant_kernels=dequantize")
    if weight.params.get("full_precision"):
        return Choice(DEQUANTIZE, "the file asks for full-precision matmuls")
    every = chosen_mode == "all"
    if weight.format == "scaled":
        codes = weight.rows["codes"]
        if codes.dtype == torch.int8:
            return _int8_choice()
        return _fp8_choice(weight, device, every)
    if weight.format in ("mxfp8", "nvfp4"):
        return _block_choice(weight.format, device, every)
    return Choice(DEQUANTIZE, f"no kernel for {weight.format}")


def _fp8_choice(weight, device, every: bool) -> Choice:
    codes = weight.rows["codes"]
    if codes.dtype != torch.float8_e4m3fn:
        return Choice(DEQUANTIZE, f"{str(codes.dtype).replace('torch.', '')}: no fp8 x fp8 kernel takes it")
    if "scale" in weight.rows:
        return Choice(DEQUANTIZE, "per-row fp8 scales")
    if weight.params.get("group"):
        return Choice(DEQUANTIZE, "rotated fp8")
    cap = capability(device)
    if cap is None and not every:
        return Choice(DEQUANTIZE, f"no fp8 compute on {device.type} (as ComfyUI)")
    if cap is not None and cap < (8, 9):
        return Choice(DEQUANTIZE, f"no fp8 tensor cores on sm {cap[0]}{cap[1]}")
    if cap is not None and (weight.shape[0] % 16 or weight.shape[1] % 16):
        return Choice(DEQUANTIZE, "fp8 matmul needs sizes divisible by 16")
    return Choice(FP8_TORCH, run=_fp8_linear)


def _int8_choice() -> Choice:
    module, why = kitchen()
    if module is None:
        return Choice(DEQUANTIZE, why)
    return Choice(INT8_KITCHEN, run=_int8_linear)


def _block_choice(name: str, device, every: bool) -> Choice:
    module, why = kitchen()
    if module is None:
        return Choice(DEQUANTIZE, why)
    cap = capability(device)
    if cap is None:
        return Choice(DEQUANTIZE, f"comfy-kitchen has no {name} matmul on {device.type} (swizzled scales)")
    if cap < (10, 0) or (name == "mxfp8" and _torch_version() < (2, 10)):
        return Choice(DEQUANTIZE, f"no {name} tensor cores on sm {cap[0]}{cap[1]} (ComfyUI emulates it too)")
    return Choice(MXFP8_KITCHEN, run=_mxfp8_linear) if name == "mxfp8" else Choice(NVFP4_KITCHEN, run=_nvfp4_linear)


def fall_back(choice: Choice, error: Exception) -> Choice:
    """The dequantize path for a layer whose kernel raised on its operands (warned once per kernel)."""
    if choice.path not in _WARNED:
        _WARNED.add(choice.path)
        log.warning("%s failed (%s: %s); those layers dequantize instead", choice.path, type(error).__name__,
                    str(error)[:300])
    return Choice(DEQUANTIZE, f"{choice.path} failed: {type(error).__name__}")


_WARNED: set[str] = set()


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


# ---------------------------------------------------------------------------------------------------------------
# The kernels: run(module, x, bias) with module a QuantLinear (its buffers quant_<part>)

def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """comfy-kitchen's per-tensor fp8 quantizer (its eager form when it is absent): x / scale, clamped."""
    module, _ = kitchen()
    if module is not None:
        return module.quantize_per_tensor_fp8(x, scale, dtype)
    limit = torch.finfo(dtype).max
    return torch.clamp(x * (1.0 / scale).to(x.dtype), -limit, limit).to(dtype)


def _fp8_linear(module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    codes = module.quant_codes
    input_scale = getattr(module, "quant_input_scale", None)
    input_scale = torch.ones((), device=x.device) if input_scale is None else input_scale
    flat = _flat(x).contiguous()
    fused_bias = bias if x.dtype in (torch.bfloat16, torch.float16) else None  # cuBLAS: no bias with fp32 output
    out = torch._scaled_mm(quantize_fp8(flat, input_scale, codes.dtype), codes.t(), scale_a=input_scale.float(),
                           scale_b=module.quant_scale.float(), bias=fused_bias, out_dtype=x.dtype)
    if bias is not None and fused_bias is None:
        out = out + bias
    return out.reshape(*x.shape[:-1], codes.shape[0])


def _int8_linear(module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    group = module.quant.params.get("group", 0)
    scale = getattr(module, "quant_scale")
    return kitchen()[0].int8_linear(x.contiguous(), module.quant_codes, scale, bias, out_dtype=x.dtype,
                                    convrot=bool(group), convrot_groupsize=group or 256)


def _padded_rows(tensor: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -tensor.shape[0] % multiple
    return torch.nn.functional.pad(tensor, (0, 0, 0, extra)) if extra else tensor


def block_operands(module) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes with rows padded, block scales in cuBLAS's swizzled layout) of an mxfp8 / nvfp4 layer, made once and
    kept while its buffers stay the same tensors."""
    codes, scales = module.quant_codes, module.quant_scale
    key = (codes.data_ptr(), scales.data_ptr(), codes.device)
    cached = getattr(module, "_block_operands", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    ck = kitchen()[0]
    if module.quant.format == "mxfp8":
        operands = (_padded_rows(codes, 32), ck.to_blocked(scales.view(torch.uint8), flatten=False)
                    .view(torch.float8_e8m0fnu))
    else:
        operands = (_padded_rows(codes, 16), ck.to_blocked(scales, flatten=False))
    module._block_operands = (key, operands)
    return operands


def _mxfp8_linear(module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    ck = kitchen()[0]
    flat = _flat(x)
    rows, width = flat.shape
    codes, scales = block_operands(module)
    if codes.shape[1] != width:
        flat = torch.nn.functional.pad(flat, (0, codes.shape[1] - width))
    qx, sx = ck.quantize_mxfp8(flat.contiguous(), pad_32x=rows % 32 != 0)
    out = ck.scaled_mm_mxfp8(qx, codes, sx, scales, bias=_padded_bias(bias, codes), out_dtype=x.dtype)
    return out[:rows, :module.out_features].reshape(*x.shape[:-1], module.out_features)


def _nvfp4_linear(module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    ck = kitchen()[0]
    flat = _flat(x)
    rows, width = flat.shape
    codes, scales = block_operands(module)
    if codes.shape[1] * 2 != width:
        flat = torch.nn.functional.pad(flat, (0, codes.shape[1] * 2 - width))
    input_scale = getattr(module, "quant_input_scale", None)
    if input_scale is None:
        input_scale = torch.amax(flat.abs()).float() / (F8_E4M3_MAX * F4_E2M1_MAX)
    qx, sx = ck.quantize_nvfp4(flat.contiguous(), input_scale.float(), pad_16x=rows % 16 != 0)
    out = ck.scaled_mm_nvfp4(qx, codes, input_scale.float(), module.quant_scale_2, sx, scales,
                             bias=_padded_bias(bias, codes), out_dtype=x.dtype)
    return out[:rows, :module.out_features].reshape(*x.shape[:-1], module.out_features)


def _padded_bias(bias: Optional[torch.Tensor], codes: torch.Tensor) -> Optional[torch.Tensor]:
    if bias is None or bias.shape[0] == codes.shape[0]:
        return bias
    return torch.nn.functional.pad(bias, (0, codes.shape[0] - bias.shape[0]))
