"""Host round trip per denoising call with a real family: what a call costs besides the worker's forward.

Flux.1 at 1024^2 ([1, 16, 128, 128]) and Wan 2.1 at 720p x 81 frames ([1, 16, 21, 90, 160]), tiny models of one block
each (Wan's skipped, as SkipLayerGuidanceDiT skips it: 75600 tokens' attention would take a CPU seconds), so the
forward is short and the round trip shows, each in a world-1 CPU pool,
called like a sampler does (same conditioning, a new latent each call, the result dropped before the next call).
Per call: host CPU time of the calling thread (primary: other processes do not inflate it), split into the call's own
work (staging, messages, reading the result) and the watchdog's polling while the worker computes (every 50 ms, in
parallel with the forward, so it adds no latency); wall time less the worker's own time; the bytes copied; and whether
any new shared-memory segment appeared. Target: call's own CPU <= 0.5 ms + one copy of the latent at this machine's
memory bandwidth, measured in the same run.

    python benchmarks/bench_host_round_trip.py     # writes benchmarks/results/host_round_trip_cpu.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sp_runtime import SPConfig  # noqa: E402
from sp_runtime.cli.machine import describe_machine, load_average, write_json  # noqa: E402
from sp_runtime.pool import WorkerPool  # noqa: E402
from sp_lab.tiny_models import write_tiny_checkpoint  # noqa: E402

CASES = {  # name: family, size, latent, conditioning
    "flux 1024^2": ("flux", dict(num_layers=1, num_single_layers=1), (1, 16, 128, 128),
                    lambda: {"context": torch.randn(1, 256, 32), "y": torch.randn(1, 24),
                             "guidance": torch.tensor([3.5])}),
    "wan 720p x 81 frames": ("wan", dict(num_layers=1), (1, 16, 21, 90, 160),
                             lambda: {"context": torch.randn(1, 512, 32), "skip_blocks": {"double_block": [0]}}),
}
FIXED_MS = 0.5


def memcpy_gbps(nbytes: int, repeats: int = 20) -> float:
    """Best copy rate of a buffer of nbytes (one thread), in GB/s."""
    source, target = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
    target.copy_(source)
    best = min(_seconds(lambda: target.copy_(source)) for _ in range(repeats))
    return nbytes / best / 1e9


def _seconds(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


class WaitClock:
    """CPU time the calling thread spends in the pool's wait for replies (requests._Wait.run), per call."""

    def __init__(self):
        from sp_runtime.pool import requests
        self.seconds, self._run = 0.0, requests._Wait.run
        clock = self

        def run(wait):
            started = time.thread_time()
            try:
                return clock._run(wait)
            finally:
                clock.seconds += time.thread_time() - started
        requests._Wait.run = run

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def measure(pool: WorkerPool, path: str, latent: tuple, conditioning: dict, calls: int, clock: WaitClock) -> dict:
    handle = pool.load_model(path)
    timestep = torch.tensor([0.5])
    latents = [torch.randn(latent) for _ in range(2)]
    for index in range(3):  # warm-up: arenas sized, conditioning resident
        handle(latents[index % 2], timestep, **conditioning)
    segments = pool.segment_names()
    cpu, own, host, walls, workers, copied = [], [], [], [], [], []
    for index in range(calls):
        clock.take()
        started, started_cpu = time.perf_counter(), time.thread_time()
        out = handle(latents[index % 2], timestep, **conditioning)
        cpu.append(time.thread_time() - started_cpu)
        own.append(cpu[-1] - clock.take())
        walls.append(time.perf_counter() - started)
        workers.append(pool.stats["last_worker_s"])
        host.append(walls[-1] - workers[-1])
        copied.append(pool.stats["last_bytes_copied"])
        del out  # as a sampler: the result is used, then dropped before the next call
    pool.unload(handle)
    return {"latent": list(latent), "latent_bytes": latents[0].nbytes,
            "host_cpu_ms": 1e3 * statistics.median(cpu), "call_cpu_ms": 1e3 * statistics.median(own),
            "call_cpu_min_ms": 1e3 * min(own),
            "wall_less_worker_ms": 1e3 * statistics.median(host), "wall_less_worker_min_ms": 1e3 * min(host),
            "wall_ms": 1e3 * statistics.median(walls), "worker_ms": 1e3 * statistics.median(workers),
            "bytes_copied_per_call": max(copied), "new_segments": pool.segment_names() != segments}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "host_round_trip_cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    loads = [load_average()]
    results, clock = {}, WaitClock()
    with tempfile.TemporaryDirectory() as folder, WorkerPool(SPConfig(["cpu"]), threads=1) as pool:
        for name, (family, size, latent, conditioning) in CASES.items():
            path = write_tiny_checkpoint(family, os.path.join(folder, f"{family}.safetensors"), **size)
            row = measure(pool, path, latent, conditioning(), args.calls, clock)
            row["memcpy_gbps"] = memcpy_gbps(row["latent_bytes"])
            row["target_ms"] = FIXED_MS + row["latent_bytes"] / (row["memcpy_gbps"] * 1e9) * 1e3
            row["call_cpu_within_target"] = row["call_cpu_ms"] <= row["target_ms"]
            results[name] = row
            loads.append(load_average())
            print(f"{name:22s} latent {row['latent_bytes'] / 1e6:5.1f} MB: call's own CPU {row['call_cpu_ms']:6.3f} ms "
                  f"(min {row['call_cpu_min_ms']:6.3f}; with the watchdog's polling {row['host_cpu_ms']:6.3f}), "
                  f"wall - worker {row['wall_less_worker_ms']:6.3f} ms (min "
                  f"{row['wall_less_worker_min_ms']:6.3f}); target {row['target_ms']:5.3f} ms (0.5 + one copy at "
                  f"{row['memcpy_gbps']:.1f} GB/s); copied {row['bytes_copied_per_call'] / 1e6:.1f} MB/call, new "
                  f"segments: {row['new_segments']}", flush=True)
    write_json(args.out, {"benchmark": "host round trip per call", "world_size": 1, "torch_threads": 1,
                          "calls": args.calls, "load_average": loads, "machine": describe_machine(),
                          "cases": results}, say=True)


if __name__ == "__main__":
    main()
