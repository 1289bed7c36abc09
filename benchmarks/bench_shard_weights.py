"""shard_weights measured on CPU workers: (1) per-rank weight bytes and RSS with and without sharding at world 2 and
4, a Qwen-Image-architecture model of ~300 MB; (2) step time with and without at 4096 tokens on the bench preset
(`demo`), the two models in one pool and their calls interleaved; (3) the "done when" demonstration: each worker's
private memory capped (RLIMIT_DATA, set on the running workers with prlimit) at what it uses idle + the file's
mapping + 0.75 x the model's size: the whole model fails to load, the sharded one loads and its output equals the
whole model's (computed before the cap), bitwise. RLIMIT_DATA counts safetensors' private (copy-on-write) mapping of
the whole file although only the touched pages are read (page cache, shared and reclaimable), hence the mapping in
the cap: what is capped below the model's size is the memory the worker owns, the part a GPU would have to hold.

Usage: python benchmarks/bench_shard_weights.py [--repeats 3] [--out benchmarks/results/shard_weights_cpu.json]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sp_runtime import SPConfig, WorkerPool  # noqa: E402
from sp_lab.cli.bench import reset_cpu_peaks  # noqa: E402
from sp_runtime.cli.machine import LoadMonitor, describe_machine, write_json  # noqa: E402
from sp_lab.cli.presets import Preset, get_preset, materialize  # noqa: E402
from sp_lab.cli.sampling import make_workload, model_timestep  # noqa: E402

MIB = 2 ** 20
BIG = Preset("shard-300mb", "qwen_image", "Qwen-Image architecture, 8 blocks, 8 heads of 64, fp32 (~300 MB)",
             512, 512, text_tokens=32,
             size=dict(num_layers=8, num_attention_heads=8, attention_head_dim=64, joint_attention_dim=64))


def rank_figures(pool) -> list[dict]:
    """Per rank: weight bytes by the worker's own accounting, RSS and peak RSS (VmHWM) from the host."""
    return [{"rank": rank["rank"], **rank["weights"], "rss": rank["memory"].get("rss"),
             "peak_rss": rank["memory"].get("peak")} for rank in pool.status()["ranks"]]


def big_workload(info):
    return make_workload("qwen_image", info.config, info.in_channels, BIG.width, BIG.height,
                         text_tokens=BIG.text_tokens)


def warm_up(pool) -> None:
    """Load and run the small demo model once (the workers import diffusers), then unload it."""
    warm = pool.load_model(materialize(get_preset("demo")), "float32")
    workload = make_workload("qwen_image", warm.info.config, warm.info.in_channels, 64, 64, text_tokens=4)
    warm(workload.noise, model_timestep("qwen_image", 0.7, 1), **workload.conditioning)
    pool.unload_all()


def memory_table(path: str, world: int) -> tuple[dict, dict]:
    """Per-rank figures idle (after a warm-up), sharded, then whole (a freed model's heap stays in the RSS, so the
    smaller one goes first; peak RSS reset before each), and the outputs of both."""
    rows, outputs = {}, {}
    with WorkerPool(SPConfig(["cpu"] * world)) as pool:
        warm_up(pool)
        rows["idle"] = rank_figures(pool)
        for shard in (True, False):
            pool.unload_all()
            reset_cpu_peaks(pool)
            handle = pool.load_model(path, "float32", shard_weights=shard)
            workload = big_workload(handle.info)
            name = "sharded" if shard else "whole"
            outputs[name] = handle(workload.noise, model_timestep("qwen_image", 0.7, 1), **workload.conditioning)
            rows[name] = rank_figures(pool)
    whole, sharded = rows["whole"][0]["resident"], rows["sharded"][0]["resident"]
    blocks = rows["sharded"][0]["sharded_blocks"]
    peaks = {name: max(rank["peak_rss"] - idle["rss"] for rank, idle in zip(rows[name], rows["idle"]))
             for name in ("whole", "sharded")}
    print(f"world {world}: peak RSS above idle {peaks['whole'] / MIB:.0f} MiB whole, {peaks['sharded'] / MIB:.0f} "
          f"MiB sharded; weights per rank {whole / MIB:.1f} MiB whole, {sharded / MIB:.1f} MiB sharded "
          f"(x{sharded / whole:.3f}; blocks {blocks / MIB:.1f} MiB, 1/{world} of them {blocks / world / MIB:.1f}); "
          f"peak gathered {rows['sharded'][0]['gathered_peak'] / MIB:.1f} MiB", flush=True)
    return {"world_size": world, "per_rank": rows, "resident_ratio": round(sharded / whole, 4),
            "peak_rss_above_idle_bytes": peaks,
            "block_bytes": blocks, "expected_ratio": round((whole - blocks + blocks / world) / whole, 4),
            "bitwise_equal": bool(torch.equal(outputs["sharded"], outputs["whole"]))}, outputs


def step_times(world: int, repeats: int) -> dict:
    """The bench preset (demo, 4096 tokens, fp32) whole and sharded in one pool, calls interleaved."""
    preset = get_preset("demo")
    path = materialize(preset)
    with WorkerPool(SPConfig(["cpu"] * world)) as pool:
        handles = {"whole": pool.load_model(path, "float32"),
                   "sharded": pool.load_model(path, "float32", shard_weights=True)}
        info = handles["whole"].info
        workload = make_workload("qwen_image", info.config, info.in_channels, preset.width, preset.height,
                                 text_tokens=preset.text_tokens)
        t = model_timestep("qwen_image", 0.7, 1)
        outputs = {name: handle(workload.noise, t, **workload.conditioning) for name, handle in handles.items()}
        moved_before = [rank["weights"]["bytes_moved"] for rank in pool.status()["ranks"]]
        times = {name: [] for name in handles}
        for _ in range(repeats):
            for name, handle in handles.items():
                handle(workload.noise, t, **workload.conditioning)
                times[name].append(pool.stats["last_call_s"])
        moved = [rank["weights"]["bytes_moved"] - before
                 for rank, before in zip(pool.status()["ranks"], moved_before)]
        blocks = pool.status()["ranks"][0]["weights"]["sharded_blocks"]
    medians = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    result = {"preset": preset.description, "world_size": world, "tokens": workload.tokens,
              "step_ms": {name: [round(v * 1e3, 1) for v in values] for name, values in times.items()},
              "median_ms": {name: round(value, 1) for name, value in medians.items()},
              "time_ratio_sharded_vs_whole": round(medians["sharded"] / medians["whole"], 4),
              "block_bytes": blocks, "weight_bytes_moved_per_step_per_rank": moved[0] // repeats,
              "bitwise_equal": bool((outputs["sharded"] == outputs["whole"]).all())}
    print(f"step at {workload.tokens} tokens, world {world}: whole {medians['whole']:.0f} ms, sharded "
          f"{medians['sharded']:.0f} ms (x{result['time_ratio_sharded_vs_whole']:.3f}); "
          f"{result['weight_bytes_moved_per_step_per_rank'] / MIB:.1f} MiB gathered per rank per step", flush=True)
    return result


def data_segment(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmData")


@contextlib.contextmanager
def capped_pool(world: int, extra_bytes: int):
    """A fresh pool warmed with the small demo model (libraries loaded, no big allocation freed into the heap), each
    worker's data segment then capped at what it uses + extra_bytes; yields (pool, {pid: cap})."""
    with WorkerPool(SPConfig(["cpu"] * world)) as pool:
        warm_up(pool)
        caps = {}
        for pid in pool.worker_pids:
            caps[pid] = data_segment(pid) + extra_bytes
            resource.prlimit(pid, resource.RLIMIT_DATA, (caps[pid], caps[pid]))
        yield pool, caps


def capped_demonstration(path: str, world: int, budget_fraction: float, want: torch.Tensor) -> dict:
    """Each worker capped at idle + the file mapping + budget_fraction x the model: the whole model in one such pool,
    the sharded one in another (a failed load may end a worker, and the pool restarts it uncapped)."""
    model_bytes = os.path.getsize(path)
    extra = model_bytes + int(budget_fraction * model_bytes)
    with capped_pool(world, extra) as (pool, caps):
        try:
            pool.load_model(path, "float32")
            whole_error = None
        except Exception as error:  # noqa: BLE001 - the expected failure is the point
            whole_error = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
    with capped_pool(world, extra) as (pool, caps):
        sharded = pool.load_model(path, "float32", shard_weights=True)
        workload = big_workload(sharded.info)
        got = sharded(workload.noise, model_timestep("qwen_image", 0.7, 1), **workload.conditioning)
        figures = rank_figures(pool)
        held = all(resource.prlimit(pid, resource.RLIMIT_DATA)[0] == cap for pid, cap in caps.items())
    result = {"world_size": world, "model_file_bytes": model_bytes, "budget_fraction_of_model": budget_fraction,
              "caps_bytes": list(caps.values()), "whole_load_error": whole_error,
              "caps_held_during_sharded_run": held, "sharded_loaded_and_ran": True,
              "bitwise_equal_to_whole": bool(torch.equal(got, want)),
              "max_abs_difference": float((got - want).abs().max()), "per_rank": figures}
    print(f"capped at idle + mapping + {budget_fraction:.2f} x {model_bytes / MIB:.0f} MiB per worker: whole load "
          f"{'failed: ' + whole_error if whole_error else 'DID NOT FAIL'}; sharded ran, bitwise equal: "
          f"{result['bitwise_equal_to_whole']}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "shard_weights_cpu.json"))
    args = parser.parse_args()
    path = materialize(BIG)
    monitor = LoadMonitor()
    result = {"machine": describe_machine(), "command": "python benchmarks/bench_shard_weights.py",
              "model": {"preset": BIG.description, "file_bytes": os.path.getsize(path)},
              "how": "weights: the workers' own accounting (pool.status() ranks[r]['weights']: 'resident' = bytes "
                     "held, 'gathered_peak' = most bytes of gathered blocks at once); rss / peak_rss from the host "
                     "(psutil, VmHWM); times: pool.stats['last_call_s'], calls interleaved",
              "memory": [], "step_time": step_times(2, args.repeats)}
    for world in (2, 4):
        table, outputs = memory_table(path, world)
        result["memory"].append(table)
    result["capped"] = capped_demonstration(path, 4, 0.75, outputs["whole"])
    result["machine_load"] = monitor.finish()
    print(result["machine_load"]["note"])
    write_json(args.out, result, say=True)


if __name__ == "__main__":
    main()
