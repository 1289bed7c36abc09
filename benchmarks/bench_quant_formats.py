"""Weight memory, numeric error and per-call time of each quantized format, side by side with bf16.

A random-weight Flux-architecture model (8 heads of 128, one double and one single block, real text width 4096) is
written once per format (sp_lab.tiny_models.quant_files: the real on-disk layouts) with the float32 weights the file
encodes. Each file is loaded in-process with the default dtype (weights kept quantized, bf16 compute) and
compared with diffusers' forward on the dequantized weights in bf16 and fp32; the quantization error itself
(dequantized weights vs the unquantized model, both in fp32) is reported too. The GGUF K-quant file holds random
blocks (gguf has no K-quant quantizer), so its "quantization error" is no measure of Q4_K.

    python benchmarks/bench_quant_formats.py          # writes benchmarks/results/quant_formats_cpu.json
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sp_lab.references.flux import reference_forward as flux_reference  # noqa: E402
from sp_runtime.cli.machine import describe_machine, median_time, write_json  # noqa: E402
from sp_runtime.families import flux  # noqa: E402
from sp_runtime.formats import weight_bytes  # noqa: E402
from sp_lab.tiny_models import write_tiny_checkpoint  # noqa: E402
from sp_lab.tiny_models.quant_files import write_quantized  # noqa: E402

SIZE = dict(num_attention_heads=8, attention_head_dim=128, num_layers=1, num_single_layers=1,
            joint_attention_dim=4096, pooled_projection_dim=768)
# name -> (file format, the one quant type of its layers)
FORMATS = {
    "scaled fp8": ("scaled_fp8", None),
    "float8_e4m3fn": ("comfy_quant", "float8_e4m3fn"),
    "int8 convrot": ("comfy_quant", "int8_tensorwise convrot"),
    "mxfp8": ("comfy_quant", "mxfp8"),
    "nvfp4": ("comfy_quant", "nvfp4"),
    "gguf Q8_0": ("gguf", "Q8_0"),
    "gguf Q4_0": ("gguf", "Q4_0"),
    "gguf Q4_K": ("gguf", "Q4_K"),
}
MIB = 2 ** 20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "quant_formats_cpu.json"))
    return parser.parse_args()


def make_call(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 16, 32, 32, generator=g)  # 256 image tokens
    inputs = {"context": torch.randn(1, 64, 4096, generator=g), "y": torch.randn(1, 768, generator=g),
              "guidance": torch.tensor([3.5])}
    return x, torch.tensor([0.5]), inputs


def relative(got: torch.Tensor, reference: torch.Tensor) -> float:
    return ((got.float() - reference.float()).abs().max() / reference.float().abs().max().clamp_min(1)).item()


def measure(folder: str, name: str, fmt: str, only, call, original_out, repeats: int) -> dict:
    path = os.path.join(folder, f"{name.replace(' ', '_')}.{'gguf' if fmt == 'gguf' else 'safetensors'}")
    reference = path + ".dequantized.safetensors"
    write_quantized("flux", path, reference, fmt, seed=0, only=only, **SIZE)
    x, t, inputs = call
    quantized = flux.load_model(path)[0]
    out = flux_reference(quantized, x, t, **inputs)
    bf16 = flux.load_model(reference, "bf16")[0]
    fp32 = flux.load_model(reference, "fp32")[0]
    bf16_out, fp32_out = (flux_reference(model, x, t, **inputs) for model in (bf16, fp32))
    result = {
        "file_mib": os.path.getsize(path) / MIB,
        "weights_mib": weight_bytes(quantized) / MIB,
        "bf16_weights_mib": weight_bytes(bf16) / MIB,
        "error_vs_dequantized_bf16": relative(out, bf16_out),
        "error_vs_dequantized_fp32": relative(out, fp32_out),
        "bf16_reference_error_vs_fp32": relative(bf16_out, fp32_out),  # bf16 compute itself, for scale
        "quantization_error_fp32": relative(fp32_out, original_out),  # the file's weights vs the unquantized
        "call_ms": 1000 * median_time(lambda: flux_reference(quantized, x, t, **inputs), repeats),
        "bf16_call_ms": 1000 * median_time(lambda: flux_reference(bf16, x, t, **inputs), repeats),
    }
    result["memory_ratio_vs_bf16"] = result["weights_mib"] / result["bf16_weights_mib"]
    print(f"{name:>14}: weights {result['weights_mib']:.1f} MiB ({result['memory_ratio_vs_bf16']:.2f}x bf16), "
          f"error vs dequantized bf16 {result['error_vs_dequantized_bf16']:.1e} / fp32 "
          f"{result['error_vs_dequantized_fp32']:.1e}, call {result['call_ms']:.0f} ms vs bf16 "
          f"{result['bf16_call_ms']:.0f} ms")
    return result


def main() -> None:
    args = parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    call = make_call()
    results = {}
    with tempfile.TemporaryDirectory() as folder, torch.no_grad():
        original = write_tiny_checkpoint("flux", os.path.join(folder, "original.safetensors"), seed=0, **SIZE)
        original_out = flux_reference(flux.load_model(original, "fp32")[0], *call[:2], **call[2])
        for name, (fmt, only) in FORMATS.items():
            results[name] = measure(folder, name, fmt, only, call, original_out, args.repeats)
    write_json(args.out, {"machine": describe_machine(), "model": {"family": "flux", **SIZE}, "tokens": 256,
                          "formats": results}, say=True)


if __name__ == "__main__":
    main()
