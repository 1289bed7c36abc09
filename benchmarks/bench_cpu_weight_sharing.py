"""CPU workers' memory with and without shared weights: RSS, USS (private) and PSS (proportional) of each worker
before and after loading a ~75 MB toy model, at 2 and 4 CPU workers, with `share_cpu_weights` off (each worker
keeps its own copy, as before) and on (one copy in shared memory that every worker maps).

Usage: python benchmarks/bench_cpu_weight_sharing.py [--out benchmarks/results/cpu_weight_sharing.json]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sp_runtime import SPConfig  # noqa: E402
from sp_runtime.cli.machine import describe_machine, write_json  # noqa: E402
from sp_runtime.detection import allow_internal_families  # noqa: E402
from sp_lab.families.toy import save_toy_checkpoint  # noqa: E402
from sp_runtime.pool import WorkerPool  # noqa: E402

MODEL = dict(hidden=512, heads=8, depth=3, context_dim=64)  # 24 x 512^2 fp32 per block: 75 MB
MIB = 1 << 20


def memory(pids: list[int]) -> dict:
    """Per-worker RSS / USS / PSS in MiB, and their sums."""
    rows = []
    for pid in pids:
        info = psutil.Process(pid).memory_full_info()
        rows.append({"rss": info.rss / MIB, "uss": info.uss / MIB, "pss": info.pss / MIB})
    return {"workers": rows, **{f"{key}_sum": sum(row[key] for row in rows) for key in ("rss", "uss", "pss")}}


def measure(path: str, workers: int, share: bool) -> dict:
    small = os.path.join(os.path.dirname(path), "small.safetensors")
    with WorkerPool(SPConfig(["cpu"] * workers), share_cpu_weights=share) as pool:
        pool.load_model(small).unload()  # the loaders' imports before the first measurement
        before = memory(pool.worker_pids)
        pool.load_model(path)
        after = memory(pool.worker_pids)
    growth = {key: after[f"{key}_sum"] - before[f"{key}_sum"] for key in ("rss", "uss", "pss")}
    return {"workers": workers, "share_cpu_weights": share, "before": before, "after": after,
            "growth_mib": growth}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/cpu_weight_sharing.json")
    args = parser.parse_args(argv)
    allow_internal_families()  # the toy checkpoints written below
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "toy.safetensors")
        save_toy_checkpoint(path, **MODEL)
        save_toy_checkpoint(os.path.join(folder, "small.safetensors"), hidden=24, heads=3)
        weights_mib = os.path.getsize(path) / MIB
        runs = [measure(path, workers, share) for workers in (2, 4) for share in (False, True)]
    for run in runs:
        growth = run["growth_mib"]
        print(f"{run['workers']} workers, share_cpu_weights={run['share_cpu_weights']!s:5}: after loading "
              f"{weights_mib:.0f} MiB of weights: RSS +{growth['rss']:.0f}, USS +{growth['uss']:.0f}, "
              f"PSS +{growth['pss']:.0f} MiB (sums over the workers)")
    write_json(args.out, {"machine": describe_machine(), "model": MODEL, "weights_mib": weights_mib,
                          "runs": runs}, say=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
