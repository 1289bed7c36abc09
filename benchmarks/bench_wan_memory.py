"""Per-rank activation memory of the sequence-parallel Wan forward at Ulysses degree 1, 2, 4.

A small-but-not-tiny random-weight Wan (4 heads of 128, real text width 4096 and 512 text tokens) runs one call on a
video latent through the worker pool at each degree. Activation memory of a rank = its peak during the call minus
what it held just before (weights, inputs, caches):
- CPU workers: peak RSS (Linux VmHWM, reset through /proc/<pid>/clear_refs before the call) minus RSS before it.
  Workers run with a fixed glibc mmap threshold so freed tensors go back to the OS and RSS tracks live memory.
- CUDA workers: torch.cuda.max_memory_allocated during the call (the pool resets it per call) minus allocated.

    python benchmarks/bench_wan_memory.py                      # CPU, writes benchmarks/results/wan_memory_cpu.json
    python benchmarks/bench_wan_memory.py --device cuda        # GPUs 0..3, writes wan_memory_cuda.json

Times in the output are for orientation only: measure them on a quiet machine.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sp_runtime.cli.machine import describe_machine, write_json  # noqa: E402
from sp_runtime.config import SPConfig  # noqa: E402
from sp_runtime.pool import WorkerPool  # noqa: E402
from sp_runtime.tiny_models import write_tiny_checkpoint  # noqa: E402

MODEL = dict(num_attention_heads=4, attention_head_dim=128, ffn_dim=2048, num_layers=2, text_dim=4096)
TEXT_TOKENS = 512
MIB = 2 ** 20
WORKER_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}  # big frees return to the OS: RSS = live memory


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--shape", type=int, nargs=3, default=[9, 40, 64], metavar=("T", "H", "W"),
                        help="latent frames, height, width (default 9 x 40 x 64: 5760 video tokens)")
    parser.add_argument("--variant", default="t2v", choices=("t2v", "ti2v"),
                        help="ti2v: 48 channels with per-frame timesteps (per-token modulation)")
    parser.add_argument("--output", default=None)
    return parser.parse_args()


def reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w", encoding="ascii") as handle:
        handle.write("5")  # resets VmHWM to the current RSS


def call_inputs(variant: str, shape, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    channels = 48 if variant == "ti2v" else 16
    frames = shape[0]
    x = torch.randn(1, channels, *shape, generator=generator)
    timestep = torch.tensor([[0.0] + [700.0] * (frames - 1)]) if variant == "ti2v" else torch.tensor([700.0])
    context = torch.randn(1, TEXT_TOKENS, MODEL["text_dim"], generator=generator)
    return x, timestep, context


def measure(path: str, degree: int, device: str, variant: str, shape) -> dict:
    devices = [f"cuda:{rank}" for rank in range(degree)] if device == "cuda" else ["cpu"] * degree
    x, timestep, context = call_inputs(variant, shape)
    with WorkerPool(SPConfig(devices), env=WORKER_ENV) as pool:
        handle = pool.load_model(path)
        handle(x, timestep, context=context)  # warm-up: lazy initialisation, input caches, allocator pools
        if device == "cpu":
            before = [entry["memory"]["rss"] for entry in pool.status()["ranks"]]
            for pid in pool.worker_pids:
                reset_peak(pid)
        started = time.perf_counter()
        handle(x, timestep, context=context)
        seconds = time.perf_counter() - started
        ranks = []
        for entry in pool.status()["ranks"]:  # CPU: RSS and peak RSS (VmHWM); CUDA: the workers' own figures
            memory, rank = entry["memory"], entry["rank"]
            if device == "cpu":
                ranks.append({"rank": rank, "rss_before_mib": before[rank] / MIB, "peak_rss_mib": memory["peak"] / MIB,
                              "activation_mib": (memory["peak"] - before[rank]) / MIB})
            else:
                ranks.append({"rank": rank, "allocated_mib": memory["allocated"] / MIB,
                              "peak_mib": memory["peak"] / MIB,
                              "activation_mib": (memory["peak"] - memory["allocated"]) / MIB})
    activations = [rank["activation_mib"] for rank in ranks]
    return {"degree": degree, "ranks": ranks, "max_activation_mib": max(activations),
            "mean_activation_mib": sum(activations) / len(activations), "call_s": seconds}


def main() -> None:
    args = parse_args()
    tokens = args.shape[0] * (-(-args.shape[1] // 2)) * (-(-args.shape[2] // 2))
    output = args.output or os.path.join(ROOT, "benchmarks", "results", f"wan_memory_{args.device}.json")
    with tempfile.TemporaryDirectory(prefix="bench_wan_") as folder:
        path = write_tiny_checkpoint("wan", os.path.join(folder, "wan_small.safetensors"), variant=args.variant,
                                     **MODEL)
        results = []
        for degree in args.degrees:
            result = measure(path, degree, args.device, args.variant, args.shape)
            print(f"degree {degree}: activation per rank max {result['max_activation_mib']:.1f} MiB, "
                  f"mean {result['mean_activation_mib']:.1f} MiB, call {result['call_s']:.2f} s", flush=True)
            results.append(result)
    base = results[0]["max_activation_mib"]
    for result in results:
        result["fraction_of_first"] = result["max_activation_mib"] / base if base else None
    report = {
        "what": "per-rank activation memory of one Wan forward (peak during the call minus memory held before)",
        "model": {**MODEL, "variant": args.variant, "dim": MODEL["num_attention_heads"] * MODEL["attention_head_dim"],
                  "dtype": "float32"},
        "latent": {"batch": 1, "frames": args.shape[0], "height": args.shape[1], "width": args.shape[2],
                   "video_tokens": tokens, "text_tokens": TEXT_TOKENS},
        "device": args.device, "machine": describe_machine(), "results": results,
        "note": "call_s was measured on a shared machine; re-measure timings on a quiet one",
    }
    write_json(output, report, say=True)


if __name__ == "__main__":
    main()
