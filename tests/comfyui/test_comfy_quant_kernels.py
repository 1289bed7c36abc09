"""Quantized layers against ComfyUI's own (issue 34), in the ComfyUI tier: each template format's QuantLinear with its
kernel equals ComfyUI's mixed-precision Linear (its ops, comfy-kitchen) on the same file's tensors and input, and
the pool at Ulysses 1 and 2 equals ComfyUI's own tiny Wan built on the same quantized file (bf16 compute, as ComfyUI
on a GPU). On CPU: fp8 through torch's scaled matmul on both sides (ComfyUI as with --supports-fp8-compute), int8 and
int8 convrot through comfy-kitchen's eager kernels; mxfp8 / nvfp4 kernels need a GPU with block-scaled tensor cores
(skipped with the reason), and their fallback is checked against ComfyUI's emulation.

Needs COMFYUI_PATH (a ComfyUI whose comfy/quant_ops.py runs comfy-kitchen) and comfy-kitchen; skipped otherwise."""
from __future__ import annotations

import json

import pytest
import torch

import comfy_support as cs
from sp_runtime.formats import choose_kernels, kernels
from sp_lab.tiny_models.quant_files import write_quantized
from test_quant_kernels import COLS, ENTRIES, ROWS, layer_file, quant_linear

pytestmark = pytest.mark.skipif(cs.comfyui_path() is None, reason=cs.NO_COMFYUI)
KERNEL_TOL = 1e-6       # the same kernel on the same operands: rounding order only
FALLBACK_TOL = 2 ** -7  # both dequantize, ComfyUI in bf16 arithmetic, we in float32 then rounded to bf16
BLOCK_FORMATS = ("mxfp8", "nvfp4")


@pytest.fixture(scope="module")
def comfy():
    cs.import_comfy()
    import comfy.ops
    try:
        import comfy.quant_ops
    except ImportError:  # ComfyUI before its quantized layers (0.3.64)
        pytest.skip("this ComfyUI has no comfy/quant_ops.py: no quantized layers to compare with")
    if not getattr(comfy.quant_ops, "_CK_AVAILABLE", False) or kernels.kitchen()[0] is None:
        pytest.skip("comfy-kitchen is not importable here: ComfyUI's quantized layers cannot run")
    return comfy.ops


def comfy_layer(ops, path: str, fp8_compute: bool):
    """ComfyUI's mixed-precision Linear (bf16 compute) loaded from the one-layer file as ComfyUI loads it (legacy
    scaled fp8 converted by convert_old_quants); fp8_compute as on a GPU with fp8 tensor cores."""
    import comfy.utils
    state, metadata = comfy.utils.load_torch_file(path, return_metadata=True)
    state, _ = comfy.utils.convert_old_quants(state, "", metadata=metadata)
    disabled = set(BLOCK_FORMATS) | (set() if fp8_compute else {"float8_e4m3fn", "float8_e5m2"})
    linear = ops.mixed_precision_ops({}, compute_dtype=torch.bfloat16, disabled=disabled).Linear(
        COLS, ROWS, bias=True, device="cpu", dtype=torch.bfloat16)
    linear.load_state_dict({key[len("l."):]: value for key, value in state.items() if key.startswith("l.")},
                           strict=False)
    return linear


def relative(got: torch.Tensor, reference: torch.Tensor) -> float:
    return (got.float() - reference.float()).abs().max().item() / reference.float().abs().max().item()


KERNEL_CASES = {"fp8": (ENTRIES["fp8"], {".input_scale": torch.tensor(0.02)}, kernels.FP8_TORCH),
                "fp8_no_input_scale": (ENTRIES["fp8"], None, kernels.FP8_TORCH),
                "scaled_fp8_legacy": ({"format": "legacy", "per_row": False}, None, kernels.FP8_TORCH),
                "int8": (ENTRIES["int8"], None, kernels.INT8_KITCHEN),
                "int8_convrot": (ENTRIES["convrot"], None, kernels.INT8_KITCHEN),
                "mxfp8": (ENTRIES["mxfp8"], None, kernels.MXFP8_KITCHEN),
                "nvfp4": (ENTRIES["nvfp4"], None, kernels.NVFP4_KITCHEN)}


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_kernel_equals_comfyuis_layer(comfy, tmp_path, case):
    entry, extra, path_name = KERNEL_CASES[case]
    if entry["format"] in BLOCK_FORMATS:
        pytest.skip(f"{entry['format']}: comfy-kitchen's block-scaled matmul needs a GPU of compute capability 10 "
                    f"or newer (its CPU backend refuses swizzled scales; ComfyUI emulates it there); the CPU "
                    f"fallback is test_fallback_equals_comfyuis_emulation")
    marker = torch.zeros(0, dtype=torch.float8_e4m3fn) if entry["format"] == "legacy" else None
    path = layer_file(tmp_path, entry, extra, seed=2, marker=marker)[0]
    ours = torch.nn.Sequential(quant_linear(path, {**entry, "format": entry["format"]}))
    assert list(choose_kernels(ours, torch.device("cpu"), "all").values()) == [path_name + " x 1"]
    theirs = comfy_layer(comfy, path, fp8_compute=True)
    x = (torch.randn(2, 9, COLS, generator=torch.Generator().manual_seed(5)) * 2).to(torch.bfloat16)
    error = relative(ours(x), theirs(x))
    print(f"{case}: kernel vs ComfyUI's layer {error:.2e}")
    assert error <= KERNEL_TOL


@pytest.mark.parametrize("name", ["fp8", "e5m2", "mxfp8", "nvfp4"])
def test_fallback_equals_comfyuis_emulation(comfy, tmp_path, name):
    """Where neither side has a kernel on the device (ComfyUI's default on CPU), both dequantize."""
    entry = ENTRIES[name]
    path = layer_file(tmp_path, entry, seed=3)[0]
    ours = torch.nn.Sequential(quant_linear(path, entry))
    assert list(choose_kernels(ours, torch.device("cpu"), "auto").values())[0].startswith(kernels.DEQUANTIZE)
    x = torch.randn(2, 9, COLS, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    error = relative(ours(x), comfy_layer(comfy, path, fp8_compute=False)(x))
    print(f"{name}: dequantize vs ComfyUI's emulation {error:.2e}")
    assert error <= FALLBACK_TOL


# ----- the pool against ComfyUI's own model on the same quantized file -----

WAN_HEAD = {"ulysses_sp.head_dim": "16"}


@pytest.fixture(scope="module")
def wan_files(tmp_path_factory):
    """A tiny Wan in ComfyUI's mixed precision (every template format in turn), and one all float8_e4m3fn."""
    folder = tmp_path_factory.mktemp("wan_quant")
    files = {}
    for name, only in (("mixed", None), ("fp8", "float8_e4m3fn")):
        path = str(folder / f"wan_{name}.safetensors")
        write_quantized("wan", path, str(folder / f"wan_{name}_reference.safetensors"), "comfy_quant", 11, "",
                        WAN_HEAD, only=only)
        files[name] = path
    return files


def comfy_wan(path: str, fp8_compute: bool):
    """ComfyUI's WAN21_T2V on the quantized file, with its mixed-precision ops in bf16 (as on a GPU)."""
    import comfy.model_management
    import comfy.supported_models
    import comfy.utils
    state, metadata = comfy.utils.load_torch_file(path, return_metadata=True)
    state, _ = comfy.utils.convert_old_quants(state, "", metadata=metadata)
    config = comfy.supported_models.WAN21_T2V(cs.newer_comfy_fields(cs.COMFY_TINY_UNET["wan"]))
    config.quant_config = comfy.utils.detect_layer_quantization(state, "")
    assert config.quant_config, "ComfyUI did not see the file as quantized"
    config.set_inference_dtype(torch.bfloat16, torch.bfloat16)
    saved = comfy.model_management.SUPPORT_FP8_OPS
    comfy.model_management.SUPPORT_FP8_OPS = fp8_compute
    try:
        model = config.get_model({})
    finally:
        comfy.model_management.SUPPORT_FP8_OPS = saved
    model.diffusion_model.load_state_dict(config.process_unet_state_dict(state), strict=False)
    return model.diffusion_model


def wan_case():
    generator = torch.Generator().manual_seed(9)
    x = torch.randn(2, 16, 5, 6, 5, generator=generator).to(torch.bfloat16)
    context = torch.randn(2, 7, 32, generator=generator).to(torch.bfloat16)
    return x, torch.tensor([500.0, 250.0]), context


@pytest.mark.parametrize("degree", [1, 2])
def test_pool_equals_comfyuis_own_model_on_the_file(comfy, wan_files, degree):
    """auto: ComfyUI's choices on CPU (int8 kernels, fp8 / mxfp8 / nvfp4 emulated); all: fp8 kernels on both
    sides (an fp8-only file: ComfyUI rounds e5m2 activations to e5m2 and then dequantizes, which we do not)."""
    from sp_runtime.config import SPConfig
    from sp_runtime.pool import WorkerPool
    x, t, context = wan_case()
    with WorkerPool(SPConfig(["cpu"] * degree)) as pool:
        for name, mode, fp8_compute in (("mixed", "auto", False), ("fp8", "all", True)):
            handle = pool.load_model(wan_files[name], head_dim=16, quant_kernels=mode)
            status = handle.info.quant_kernels
            if name == "mixed":
                assert status["int8_tensorwise convrot"].startswith(kernels.INT8_KITCHEN), status
                assert status["mxfp8"].startswith(kernels.DEQUANTIZE), status
            else:
                assert status == {"float8_e4m3fn": status["float8_e4m3fn"]} and \
                    status["float8_e4m3fn"].startswith(kernels.FP8_TORCH), status
            got = handle(x.float(), t, context=context.float())
            with torch.no_grad():
                reference = comfy_wan(wan_files[name], fp8_compute)(x, t, context)
            error = relative(got, reference)
            print(f"pool U{degree} {name} ({mode}) vs ComfyUI's own model: {error:.2e}")
            assert error <= 8 * 2 ** -8  # bf16 compute: the tests' BF16_TOL
            pool.unload(handle)
