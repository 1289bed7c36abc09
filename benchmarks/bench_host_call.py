"""Host time per denoising call: what the ComfyUI process spends on one call besides the workers' forward.

A tiny Qwen-Image in ComfyUI's mixed precision (comfy_quant: fp8, int8, mxfp8, nvfp4 layers) on one CPU worker,
called 50 times the way the SP MODEL calls it (the pool owner with a ModelSpec, nodes/pool_owner.py, no ComfyUI),
and 50 times through the model handle itself. host_ms = wall time of the call minus the slowest worker's forward;
host_cpu_ms = CPU time of the calling thread (what the host computes: staging, messages, path checks, detection),
which other processes on a busy machine do not inflate.

Usage: python benchmarks/bench_host_call.py [--calls 50] [--out benchmarks/results/host_call.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sp_runtime import SPConfig  # noqa: E402
from sp_runtime.cli.machine import describe_machine, write_json  # noqa: E402
from sp_runtime.pool import WorkerPool  # noqa: E402
from sp_lab.tiny_models.quant_files import write_quantized  # noqa: E402


def node_modules():
    """nodes.pool_owner and nodes.model_spec of this repository, imported as ComfyUI would (they need no ComfyUI)."""
    name = "ulysses_sp_bench"
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "__init__.py"),
                                                  submodule_search_locations=[ROOT])
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    return importlib.import_module(f"{name}.nodes.pool_owner"), importlib.import_module(f"{name}.nodes.model_spec")


def measure(call, pool: WorkerPool, calls: int) -> dict:
    """Median and mean wall / worker / host milliseconds over `calls` calls after 3 warm-up calls."""
    for _ in range(3):
        call()
    walls, workers, cpu = [], [], []
    for _ in range(calls):
        started, started_cpu = time.perf_counter(), time.thread_time()
        call()
        cpu.append(time.thread_time() - started_cpu)
        walls.append(time.perf_counter() - started)
        workers.append(pool.stats["last_worker_s"])
    hosts = [wall - worker for wall, worker in zip(walls, workers)]
    return {f"{name}_{stat.__name__}_ms": round(1000 * stat(values), 3)
            for name, values in (("wall", walls), ("worker", workers), ("host", hosts), ("host_cpu", cpu))
            for stat in (statistics.median, statistics.mean)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "host_call.json"))
    parser.add_argument("--label", default="", help="what code ran (e.g. 'before: main f71612d')")
    args = parser.parse_args()
    torch.manual_seed(0)
    pool_owner, model_spec = node_modules()
    x, timestep, context = torch.randn(1, 16, 1, 8, 8), torch.tensor([0.5]), torch.randn(1, 6, 32)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "qwen_image_mixed.safetensors")
        kinds = write_quantized("qwen_image", path, os.path.join(folder, "reference.safetensors"), "comfy_quant")
        owner = pool_owner.PoolOwner(lambda config: WorkerPool(config, threads=1))
        try:
            spec = model_spec.ModelSpec.create(SPConfig(devices=["cpu"]), path)
            handle = owner.load(spec)
            pool = owner.pool_for(spec.config)
            proxy = proxy_call(owner, spec)
            results = {"node path (pool owner + ModelSpec, as the SP MODEL calls)":
                       measure(lambda: proxy(x, timestep, context), pool, args.calls),
                       "model handle": measure(lambda: handle(x, timestep, context=context), pool, args.calls)}
        finally:
            owner.close_all()
    git = os.popen(f"git -C {ROOT} log -1 --format=%h 2>/dev/null").read().strip()
    data = {"benchmark": "host time per call", "label": args.label, "commit": git, "calls": args.calls,
            "load_average": os.getloadavg(), "machine": describe_machine(),
            "model": f"tiny qwen_image, comfy_quant mixed precision ({len(kinds)} quantized layers), 1 CPU worker",
            "latent": list(x.shape), "results": results}
    for name, numbers in results.items():
        print(f"{name}: host CPU {numbers['host_cpu_median_ms']:.3f} ms median, "
              f"host {numbers['host_median_ms']:.3f} ms median ({numbers['host_mean_ms']:.3f} mean), "
              f"wall {numbers['wall_median_ms']:.3f} ms, worker {numbers['worker_median_ms']:.3f} ms")
    write_json(args.out, data, say=True)


def proxy_call(owner, spec):
    """One SP MODEL call as nodes/proxy.SPDiffusionModel makes it: the handle it holds when the owner offers one
    (owner.serving), else the owner's call by ModelSpec (older code)."""
    if hasattr(owner, "serving"):
        held = [None]

        def call(x, timestep, context):
            held[0] = owner.serving(spec, held[0])
            return held[0](x, timestep, context=context)
        return call
    return lambda x, timestep, context: owner.call(spec, x, timestep, context=context)


if __name__ == "__main__":
    main()
