"""Pool overhead benchmark: one call through a world-1 pool vs the same (near-free) toy forward in-process.

For latents from a 512^2 image to a 720p 81-frame video it reports the per-call overhead (pool minus in-process),
the bytes moved through shared memory (x in, result out) and the copy rate that overhead implies, against the
target "overhead <= 2 ms + copy time at 2 GB/s", plus the conditioning bytes copied on repeat calls (target 0).
The conditioning is a Wan-sized context [1, 512, 4096] fp32; conditioning_check_ms is the extra cost when it is
rebuilt as a new tensor with the same content each call (as ComfyUI does), which the pool compares with its copy.

Usage: python benchmarks/bench_pool_overhead.py [--repeats 20] [--threads 1] [--out benchmarks/results/pool_overhead.json]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sp_runtime.cli.machine import describe_machine, timings, write_json  # noqa: E402
from sp_runtime import SPConfig  # noqa: E402
from sp_runtime.detection import allow_internal_families  # noqa: E402
from sp_lab.families.toy import ToyReference, save_toy_checkpoint  # noqa: E402
from sp_runtime.pool import WorkerPool  # noqa: E402

CASES = [  # name, latent shape (ComfyUI layout)
    ("tiny [1,16,8,8] (fixed cost)", (1, 16, 8, 8)),
    ("512^2 image", (1, 16, 64, 64)),
    ("1024^2 image", (1, 16, 128, 128)),
    ("480p 81 frames", (1, 16, 21, 60, 104)),
    ("720p 81 frames", (1, 16, 21, 90, 160)),
]
CONTEXT_SHAPE = (1, 512, 4096)
TARGET_FIXED_MS, TARGET_GBPS = 2.0, 2.0


def timed_ms(fn, repeats: int) -> tuple[float, float]:
    """(median, best) milliseconds over `repeats` calls after 3 warm-up calls."""
    times = timings(fn, repeats, warmups=3)
    return 1000 * statistics.median(times), 1000 * min(times)


def measure(pool: WorkerPool, checkpoints: dict, shape: tuple, context: torch.Tensor, repeats: int) -> dict:
    path = checkpoints[len(shape)]
    model, local = pool.load_model(path), ToyReference(path)
    x = torch.randn(shape)
    timestep = torch.tensor([0.5])
    assert torch.equal(model(x, timestep, context=context.clone()), local(x, timestep, context)), \
        "pool output differs from the in-process forward"
    conditioning = []

    def through_pool(fresh_context: bool):
        model(x, timestep.clone(), context=context.clone() if fresh_context else context)
        conditioning.append(pool.stats["last_conditioning_bytes_copied"])

    inproc_ms, inproc_best = timed_ms(lambda: local(x, timestep, context), repeats)
    pool_ms, pool_best = timed_ms(lambda: through_pool(False), repeats)
    worker_ms = 1000 * pool.stats["last_worker_s"]
    rebuilt_ms, _ = timed_ms(lambda: through_pool(True), repeats)
    clone_ms, _ = timed_ms(lambda: context.clone(), repeats)
    moved = 2 * x.nbytes  # x into the input arena, the result out of the output arena
    overhead_ms = max(pool_ms - inproc_ms, 1e-6)
    best_overhead_ms = max(pool_best - inproc_best, 1e-6)
    budget_ms = TARGET_FIXED_MS + moved / (TARGET_GBPS * 1e9) * 1000
    return {"shape": list(shape), "x_mb": x.nbytes / 1e6, "inprocess_ms": inproc_ms, "pool_ms": pool_ms,
            "inprocess_best_ms": inproc_best, "pool_best_ms": pool_best, "worker_forward_ms": worker_ms,
            "overhead_ms": overhead_ms, "best_overhead_ms": best_overhead_ms, "bytes_moved": moved,
            "implied_copy_gbps": moved / (overhead_ms / 1000) / 1e9,
            "best_implied_copy_gbps": moved / (best_overhead_ms / 1000) / 1e9, "target_ms": budget_ms,
            "within_target": overhead_ms <= budget_ms, "best_within_target": best_overhead_ms <= budget_ms,
            "conditioning_check_ms": max(rebuilt_ms - pool_ms - clone_ms, 0.0),
            "conditioning_bytes_on_repeat_calls": max(conditioning[3:]),
            "conditioning_bytes_first_call": context.nbytes}


def memcpy_gbps(nbytes: int) -> float:
    source, target = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
    ms, _ = timed_ms(lambda: target.copy_(source), 10)
    return nbytes / (ms / 1000) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads in this process and in the worker (1: copies are not disturbed by "
                             "OpenMP waits on a busy machine)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "pool_overhead.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    context = torch.randn(CONTEXT_SHAPE)
    allow_internal_families()  # the toy checkpoints written below
    with tempfile.TemporaryDirectory() as folder:
        checkpoints = {}
        for ndim in (4, 5):
            checkpoints[ndim] = os.path.join(folder, f"toy{ndim}.safetensors")
            save_toy_checkpoint(checkpoints[ndim], in_channels=16, context_dim=CONTEXT_SHAPE[-1], x_ndim=ndim,
                                passthrough=True, depth=0, heads=4)
        with WorkerPool(SPConfig(["cpu"]), threads=args.threads) as pool:
            rows = {}
            for name, shape in CASES:
                rows[name] = measure(pool, checkpoints, shape, context, args.repeats)
                row = rows[name]
                print(f"{name:30s} x {row['x_mb']:5.1f} MB  in-process {row['inprocess_ms']:6.2f} ms  pool "
                      f"{row['pool_ms']:6.2f} ms  overhead median {row['overhead_ms']:6.2f} / best "
                      f"{row['best_overhead_ms']:6.2f} ms (target <= {row['target_ms']:5.2f})  implied copy "
                      f"{row['implied_copy_gbps']:5.2f} / {row['best_implied_copy_gbps']:5.2f} GB/s  "
                      f"context check {row['conditioning_check_ms']:5.2f} ms  "
                      f"conditioning on repeat {row['conditioning_bytes_on_repeat_calls']} B", flush=True)
    result = {"benchmark": "pool_overhead", "world_size": 1, "device": "cpu",
              "target": f"overhead <= {TARGET_FIXED_MS} ms + bytes moved at {TARGET_GBPS} GB/s; 0 conditioning "
                        f"bytes on repeat calls",
              "machine": {**describe_machine(), "memcpy_gbps_20mb": memcpy_gbps(20 * 2 ** 20)},
              "note": "measured on a shared 2-core machine while other jobs were running (load average "
                      f"{os.getloadavg()[0]:.1f}): re-measure on a quiet machine before quoting absolute numbers; "
                      "best_* fields (fastest of the repeats) are the least disturbed figures",
              "context_shape": list(CONTEXT_SHAPE), "repeats": args.repeats, "torch_threads": args.threads,
              "cases": rows}
    write_json(args.out, result, say=True)


if __name__ == "__main__":
    main()
