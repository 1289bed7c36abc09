"""Low-precision kernels of quantized Linear layers (sp_runtime.formats.kernels): which matmul each ComfyUI layer
format takes per device, comfy-kitchen presence and mode; the fp8 kernel (torch's scaled matmul, which runs on CPU)
and comfy-kitchen's int8 / convrot kernels (when it is importable, else skipped) against independent references of
ComfyUI's activation handling; the file's input scales and full-precision flag; the load status."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from sp_runtime.formats import QuantLinear, choose_kernels, comfy_quant, kernels, open_weights
from sp_lab.tiny_models.quant_files import _quantize, _regular_hadamard

ROWS, COLS = 96, 256
NO_KITCHEN = (None, "comfy-kitchen not importable (ModuleNotFoundError)")
FAKE_KITCHEN = (object(), "")


def layer_file(tmp_path, entry: dict, extra: dict | None = None, seed: int = 0, marker=None) -> tuple:
    """A one-layer ComfyUI file `l` quantized as `entry` (the project's tiny writer); returns (path, float32
    weight it encodes, bias)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(ROWS, COLS, generator=generator) * 0.05
    bias = torch.randn(ROWS, generator=generator) * 0.1
    parts, encoded = _quantize(weight, entry)
    state = {"l" + suffix: part for suffix, part in {**parts, **(extra or {})}.items()}
    state["l.bias"] = bias
    if marker is not None:
        state["scaled_fp8"] = marker
    elif entry["format"] != "legacy":
        state["l.comfy_quant"] = torch.tensor(list(json.dumps(entry).encode()), dtype=torch.uint8)
    path = str(tmp_path / f"layer_{len(list(tmp_path.iterdir()))}.safetensors")
    save_file(state, path)
    return path, encoded, bias


def quant_linear(path: str, entry: dict) -> QuantLinear:
    with open_weights(path, "cpu") as handle:
        weight = comfy_quant.read_weight(handle, "l", entry, set(handle.keys()))
        bias = handle.get_tensor("l.bias")
    return QuantLinear(weight, bias)


ENTRIES = {"fp8": {"format": "float8_e4m3fn"}, "e5m2": {"format": "float8_e5m2"},
           "fp8_per_row": {"format": "legacy", "per_row": True}, "int8": {"format": "int8_tensorwise"},
           "convrot": {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 64},
           "mxfp8": {"format": "mxfp8"}, "nvfp4": {"format": "nvfp4"}}
K = kernels
# (device, capability, kitchen, mode) -> path per entry
CHOICES = [
    ("cpu", None, NO_KITCHEN, "auto", dict(fp8=K.DEQUANTIZE, e5m2=K.DEQUANTIZE, fp8_per_row=K.DEQUANTIZE,
                                           int8=K.DEQUANTIZE, convrot=K.DEQUANTIZE, mxfp8=K.DEQUANTIZE,
                                           nvfp4=K.DEQUANTIZE)),
    ("cpu", None, FAKE_KITCHEN, "auto", dict(fp8=K.DEQUANTIZE, int8=K.INT8_KITCHEN, convrot=K.INT8_KITCHEN,
                                             mxfp8=K.DEQUANTIZE, nvfp4=K.DEQUANTIZE)),
    ("cpu", None, NO_KITCHEN, "all", dict(fp8=K.FP8_TORCH, e5m2=K.DEQUANTIZE, fp8_per_row=K.DEQUANTIZE,
                                          int8=K.DEQUANTIZE)),
    ("cuda", (9, 0), FAKE_KITCHEN, "auto", dict(fp8=K.FP8_TORCH, e5m2=K.DEQUANTIZE, int8=K.INT8_KITCHEN,
                                                mxfp8=K.DEQUANTIZE, nvfp4=K.DEQUANTIZE)),
    ("cuda", (9, 0), NO_KITCHEN, "auto", dict(fp8=K.FP8_TORCH, int8=K.DEQUANTIZE, mxfp8=K.DEQUANTIZE)),
    ("cuda", (8, 6), FAKE_KITCHEN, "all", dict(fp8=K.DEQUANTIZE, int8=K.INT8_KITCHEN)),
    ("cuda", (10, 0), FAKE_KITCHEN, "auto", dict(fp8=K.FP8_TORCH, mxfp8=K.MXFP8_KITCHEN, nvfp4=K.NVFP4_KITCHEN)),
    ("cuda", (10, 0), FAKE_KITCHEN, "dequantize", dict(fp8=K.DEQUANTIZE, int8=K.DEQUANTIZE, mxfp8=K.DEQUANTIZE)),
]


@pytest.fixture(scope="module")
def layers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("layers")
    return {name: quant_linear(layer_file(folder, entry)[0], entry) for name, entry in ENTRIES.items()}


@pytest.mark.parametrize("device, cap, kitchen, mode, expected", CHOICES)
def test_each_format_takes_the_kernel_its_device_offers(layers, monkeypatch, device, cap, kitchen, mode, expected):
    monkeypatch.setattr(kernels, "kitchen", lambda: kitchen)
    monkeypatch.setattr(kernels, "capability", lambda _device: cap)
    for name, path in expected.items():
        choice = kernels.choose(layers[name].quant, torch.device(device), mode)
        assert choice.path == path, (name, choice)
        assert (choice.run is None) == (path == K.DEQUANTIZE) and bool(choice.why) == (path == K.DEQUANTIZE)
    if kitchen is NO_KITCHEN and "int8" in expected and expected["int8"] == K.DEQUANTIZE and mode != "dequantize":
        assert "comfy-kitchen not importable" in kernels.choose(layers["int8"].quant, torch.device(device), mode).why


def test_mode_comes_from_the_load_option_else_the_environment(monkeypatch):
    monkeypatch.delenv(kernels.MODE_ENV, raising=False)
    assert kernels.mode() == "auto" and kernels.mode("all") == "all"
    monkeypatch.setenv(kernels.MODE_ENV, "dequantize")
    assert kernels.mode() == "dequantize" and kernels.mode("auto") == "auto"
    with pytest.raises(ValueError, match="quant_kernels must be one of auto, dequantize, all"):
        kernels.mode("fast")
    monkeypatch.setenv(kernels.MODE_ENV, "turbo")
    with pytest.raises(ValueError, match=kernels.MODE_ENV):
        kernels.mode()


def fp8_reference(x: torch.Tensor, encoded: torch.Tensor, bias: torch.Tensor, input_scale: float) -> torch.Tensor:
    """ComfyUI's fp8 linear written out: x / input_scale in x's dtype, clamped to +-448, rounded to e4m3, times
    the scales, matmul in float32."""
    scaled = torch.clamp(x * torch.tensor(1.0 / input_scale).to(x.dtype), -448, 448)
    activations = scaled.to(torch.float8_e4m3fn).float() * input_scale
    return activations @ encoded.t() + bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_kernel_quantizes_activations_as_comfyui(tmp_path, dtype):
    input_scale = 0.02
    entry = ENTRIES["fp8"]
    path, encoded, bias = layer_file(tmp_path, entry, {".input_scale": torch.tensor(input_scale)})
    model = torch.nn.Sequential(quant_linear(path, entry))
    assert choose_kernels(model, torch.device("cpu"), "all") == {"float8_e4m3fn": K.FP8_TORCH + " x 1"}
    x = (torch.randn(2, 9, COLS, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    got = model(x)
    reference = fp8_reference(x, encoded, bias, input_scale)
    scale = reference.abs().max().item()
    assert got.dtype == dtype and got.shape == (2, 9, ROWS)
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -8
    assert (got.float() - reference).abs().max().item() <= tolerance * scale
    choose_kernels(model, torch.device("cpu"), "dequantize")
    unquantized = (model(x).float() - reference).abs().max().item() / scale
    assert unquantized > 10 * tolerance  # the activation rounding is what the test sees


def int8_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias, group: int) -> torch.Tensor:
    """comfy-kitchen's int8 linear written out (float32 input): activations rotated per group (convrot), rounded
    per row to int8 with scale amax / 127, integer matmul, times both scales."""
    if group:
        x = (x.reshape(*x.shape[:-1], -1, group) @ _regular_hadamard(group)).reshape(x.shape)
    row_scale = (x.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-30)
    rounded = (x / row_scale).round().clamp(-128, 127)
    products = (rounded.double() @ codes.double().t()).float()
    return products * (row_scale * scale.reshape(1, -1)) + bias


@pytest.mark.parametrize("name", ["int8", "convrot"])
def test_int8_kernels_quantize_activations_per_row(tmp_path, name):
    if kernels.kitchen()[0] is None:
        pytest.skip(f"{kernels.kitchen()[1]}: the int8 kernels are comfy-kitchen's; this Python falls back to "
                    f"dequantize (test_each_format_takes_the_kernel_its_device_offers)")
    entry = ENTRIES[name]
    path, _, bias = layer_file(tmp_path, entry)
    layer = quant_linear(path, entry)
    model = torch.nn.Sequential(layer)
    assert list(choose_kernels(model, torch.device("cpu"), "auto").values()) == [K.INT8_KITCHEN + " x 1"]
    x = torch.randn(2, 9, COLS, generator=torch.Generator().manual_seed(4))
    reference = int8_reference(x, layer.quant_codes, layer.quant_scale, bias, layer.quant.params["group"])
    got = model(x)
    assert (got - reference).abs().max().item() <= 1e-5 * reference.abs().max().item()


def test_file_flags_input_scales_and_full_precision(tmp_path):
    entry = ENTRIES["fp8"]
    unit = quant_linear(layer_file(tmp_path, entry)[0], entry)  # the writer's input scale 1: the default, dropped
    assert "input_scale" not in unit.quant.consts
    scaled = quant_linear(layer_file(tmp_path, entry, {".input_scale": torch.tensor(0.5)})[0], entry)
    assert scaled.quant.consts["input_scale"].item() == 0.5
    legacy = {"format": "legacy", "per_row": False}
    path = layer_file(tmp_path, legacy, marker=torch.zeros(2, dtype=torch.float8_e4m3fn))[0]
    with open_weights(path, "cpu") as handle:
        header = {key: ("F8_E4M3" if key == "scaled_fp8" else "F32", list(handle.get_slice(key).get_shape()))
                  for key in handle.keys()}
    entries = comfy_quant.layer_entries(path, header, {}, "", None)
    assert entries == {"l": {"format": "legacy", "full_precision_matrix_mult": True}}
    full = quant_linear(path, entries["l"])
    choice = kernels.choose(full.quant, torch.device("cpu"), "all")
    assert choice.path == K.DEQUANTIZE and "full-precision" in choice.why


def test_load_status_names_each_formats_path(layers, monkeypatch):
    monkeypatch.setattr(kernels, "kitchen", lambda: NO_KITCHEN)
    model = torch.nn.Sequential(*layers.values())
    status = choose_kernels(model, torch.device("cpu"), "all")
    assert status == {
        "float8_e4m3fn": K.FP8_TORCH + " x 1",
        "float8_e4m3fn per-row": "dequantize (per-row fp8 scales) x 1",
        "float8_e5m2": "dequantize (float8_e5m2: no fp8 x fp8 kernel takes it) x 1",
        "int8_tensorwise": f"dequantize ({NO_KITCHEN[1]}) x 1",
        "int8_tensorwise convrot": f"dequantize ({NO_KITCHEN[1]}) x 1",
        "mxfp8": f"dequantize ({NO_KITCHEN[1]}) x 1",
        "nvfp4": f"dequantize ({NO_KITCHEN[1]}) x 1"}
    x = torch.randn(3, COLS)
    for layer in layers.values():  # the fallback is the old dequantize-then-matmul, bit for bit
        expected = torch.nn.functional.linear(x, layer.quant.dequantize(torch.float32), layer.bias)
        if layer.kernel.run is None:
            assert torch.equal(layer(x), expected)


def test_a_kernel_that_refuses_its_operands_falls_back_to_dequantize(layers, monkeypatch):
    layer = layers["fp8"]
    def refuse(module, x, bias):
        raise RuntimeError("mat2 shape must be divisible by 16")
    layer.kernel = kernels.Choice(K.FP8_TORCH, run=refuse)
    x = torch.randn(3, COLS)
    expected = torch.nn.functional.linear(x, layer.quant.dequantize(torch.float32), layer.bias)
    assert torch.equal(layer(x), expected)
    assert layer.kernel.path == K.DEQUANTIZE and "failed: RuntimeError" in layer.kernel.why
    def out_of_memory(module, x, bias):
        raise torch.OutOfMemoryError("CUDA out of memory")
    layer.kernel = kernels.Choice(K.FP8_TORCH, run=out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        layer(x)


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("rows", [ROWS, 40])
def test_block_kernels_get_their_operands_in_cublas_layout(layers, name, rows):
    """The mxfp8 / nvfp4 kernels need a GPU of compute capability 10+; what can be checked on a CPU is their
    weight operands (rows padded, block scales swizzled back, also after a row slice such as a fused qkv's): they
    dequantize, by comfy-kitchen's own dequantizer, to our weight."""
    ck = kernels.kitchen()[0]
    if ck is None:
        pytest.skip(kernels.kitchen()[1])
    layer = QuantLinear(layers[name].quant.map_rows(lambda part: part[:rows]), None)
    codes, scales = kernels.block_operands(layer)
    assert codes.shape[0] % (32 if name == "mxfp8" else 16) == 0
    if name == "mxfp8":
        values = ck.dequantize_mxfp8(codes, scales, torch.float32)
    else:
        values = ck.dequantize_nvfp4(codes, layer.quant_scale_2, scales, torch.float32)
    assert torch.equal(values[:rows], layer.quant.dequantize(torch.float32))
    assert kernels.block_operands(layer)[1] is scales  # made once per buffers
