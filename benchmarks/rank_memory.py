"""Per-rank activation memory of one pool call (shared by the model memory benchmarks): peak during the call minus
what each rank held just before (weights, inputs, caches).

- CPU workers: peak RSS (Linux VmHWM, reset through /proc/<pid>/clear_refs before the call) minus RSS before it.
  Workers run with a fixed glibc mmap threshold so freed tensors go back to the OS and RSS tracks live memory.
- CUDA workers: torch.cuda.max_memory_allocated during the call (the pool resets it per call) minus allocated.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sp_runtime.config import SPConfig  # noqa: E402
from sp_runtime.pool import WorkerPool  # noqa: E402

MIB = 2 ** 20
WORKER_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}  # big frees return to the OS: RSS = live memory


def reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w", encoding="ascii") as handle:
        handle.write("5")  # resets VmHWM to the current RSS


def measure(path: str, degree: int, device: str, call: Callable) -> dict:
    """Load `path` on `degree` ranks, run call(handle) once to warm up and once measured."""
    devices = [f"cuda:{rank}" for rank in range(degree)] if device == "cuda" else ["cpu"] * degree
    with WorkerPool(SPConfig(devices), env=WORKER_ENV) as pool:
        handle = pool.load_model(path)
        call(handle)  # warm-up: lazy initialisation, input caches, allocator pools
        if device == "cpu":
            before = [entry["memory"]["rss"] for entry in pool.status()["ranks"]]
            for pid in pool.worker_pids:
                reset_peak(pid)
        started = time.perf_counter()
        call(handle)
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


def with_fractions(results: list[dict]) -> list[dict]:
    """Each result's peak as a fraction of the first degree's."""
    base = results[0]["max_activation_mib"]
    for result in results:
        result["fraction_of_first"] = result["max_activation_mib"] / base if base else None
    return results
