"""Side by side in one pool: the same model loaded plain, with fp8_exchange, with overlap, and with both; their
calls interleaved (round robin) so that machine load hits every variant alike. Reports per variant the median
call time, its ratio to plain, the Ulysses exchange bytes per step and the max difference from plain.

Usage: python benchmarks/bench_exchange_options.py [--preset demo] [--dtypes float32 bfloat16] [--repeats 5]
Writes benchmarks/results/exchange_options_cpu.json (CPU workers; on GPUs pass --devices cuda:0,cuda:1 and --out).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sp_runtime import SPConfig, WorkerPool  # noqa: E402
from sp_runtime.attention.fp8_exchange import INPUT_CODEC, OUTPUT_CODEC  # noqa: E402
from sp_runtime.cli.comm import AttentionShape, step_exchanges  # noqa: E402
from sp_runtime.cli.machine import LoadMonitor, describe_machine, parse_devices, write_json  # noqa: E402
from sp_lab.cli.presets import get_preset, materialize  # noqa: E402
from sp_lab.cli.sampling import make_workload, model_timestep  # noqa: E402

VARIANTS = {"plain": {}, "fp8_exchange": {"fp8_exchange": True}, "overlap": {"overlap": True},
            "fp8_exchange+overlap": {"fp8_exchange": True, "overlap": True}}


def exchange_bytes(info, workload, config, dtype: str, fp8: bool) -> int:
    """Bytes one rank sends per step in the Ulysses all-to-alls (fp8_exchange: the codes' bytes per row of D values:
    8-bit q / k / v, 12-bit output)."""
    shape = AttentionShape.of(info.family, info.config)
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    total = 0
    for exchange in step_exchanges(shape, config, workload.tokens, workload.text_tokens, workload.batch):
        codec = INPUT_CODEC if "to heads" in exchange.name else OUTPUT_CODEC
        per_value = codec.row_bytes(shape.head_dim) / shape.head_dim if fp8 else element
        total += int(exchange.elements * exchange.sent_fraction * exchange.calls * per_value)
    return total


def measure(pool, config, path: str, preset, dtype: str, repeats: int, seed: int) -> dict:
    handles = {name: pool.load_model(path, dtype, **options) for name, options in VARIANTS.items()}
    info = handles["plain"].info
    workload = make_workload(info.family, info.config, info.in_channels, preset.width, preset.height,
                             text_tokens=preset.text_tokens, seed=seed)
    t = model_timestep(info.family, 0.7, workload.batch)
    outputs, times = {}, {name: [] for name in VARIANTS}
    for name, handle in handles.items():  # warm-up
        outputs[name] = handle(workload.noise, t, **workload.conditioning)
    for _ in range(repeats):
        for name, handle in handles.items():
            handle(workload.noise, t, **workload.conditioning)
            times[name].append(pool.stats["last_call_s"])
    plain_ms = statistics.median(times["plain"]) * 1e3
    scale = max(1.0, float(outputs["plain"].abs().max()))
    rows = {}
    for name in VARIANTS:
        median_ms = statistics.median(times[name]) * 1e3
        rows[name] = {"median_ms": round(median_ms, 2), "step_ms": [round(s * 1e3, 2) for s in times[name]],
                      "time_vs_plain": round(median_ms / plain_ms, 4),
                      "exchange_bytes_per_step": exchange_bytes(info, workload, config, info.compute_dtype,
                                                                "fp8" in name),
                      "max_abs_difference_vs_plain": float((outputs[name] - outputs["plain"]).abs().max()),
                      "output_scale": scale}
    return {"workload": workload.describe(), "variants": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--devices", default="cpu*2")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "exchange_options_cpu.json"))
    args = parser.parse_args()
    config = SPConfig(parse_devices(args.devices))
    preset = get_preset(args.preset)
    path = materialize(preset)
    monitor = LoadMonitor()
    result = {"machine": describe_machine(), "devices": list(config.devices), "layout": config.layout_name,
              "preset": preset.description, "repeats": args.repeats,
              "how": "one pool, four loads of the same file with different load options, calls interleaved; time "
                     "= pool.stats['last_call_s'] (host wall time of one diffusion_model call)", "dtypes": {}}
    with WorkerPool(config) as pool:
        for dtype in args.dtypes:
            result["dtypes"][dtype] = measure(pool, config, path, preset, dtype, args.repeats, seed=0)
            for name, row in result["dtypes"][dtype]["variants"].items():
                print(f"{dtype:<9} {name:<21} {row['median_ms']:>9.1f} ms  x{row['time_vs_plain']:.3f}  "
                      f"{row['exchange_bytes_per_step'] / 2**20:>7.2f} MiB/step  max diff "
                      f"{row['max_abs_difference_vs_plain']:.2e} (scale {row['output_scale']:.1f})", flush=True)
    result["machine_load"] = monitor.finish()
    print(result["machine_load"]["note"])
    write_json(args.out, result, say=True)


if __name__ == "__main__":
    main()
