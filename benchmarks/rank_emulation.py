"""Rank emulation: one rank's share of a Ulysses-P step on one device, timed, plus the exchange time from the bytes
each all-to-all moves at a link bandwidth; checked against the real P-rank gloo run on this machine.

The emulated rank runs the family's real worker forward as rank r of P (its tokens through every token-local layer,
full-sequence attention for its H/P heads); torch.distributed.all_to_all_single is replaced by a local copy of the
same buffer (same shapes and memory traffic; the values are this rank's own, which costs the same). Prediction =
emulated time x max(1, P x threads / cores) (P CPU ranks on fewer cores share them) + the recorded all-to-all bytes
at the link measured by the doctor's all-to-all sweep over P gloo ranks (sp_runtime.cli.linkprobe). Emulated and
real runs alternate, so machine load hits both alike; medians are reported with the load average. Each forward's
process CPU time is recorded too: on a machine other work keeps busy it compares the ranks' work without the waits
for cores.

Usage: python benchmarks/rank_emulation.py [--family qwen_image] [--degrees 2 4] [--repeats 3]
Writes benchmarks/results/rank_emulation_cpu.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sp_runtime.cli.linkprobe import all_to_all_sweep, run_ranks  # noqa: E402
from sp_runtime.cli.machine import LoadMonitor, describe_machine, load_average, write_json  # noqa: E402
from sp_runtime.cli.speed_model import transfer_seconds  # noqa: E402
from sp_lab.tiny_models import tiny_config  # noqa: E402

SIZES = {"qwen_image": dict(num_layers=2, num_attention_heads=8, attention_head_dim=64, joint_attention_dim=64),
         "flux": dict(num_layers=1, num_single_layers=2, num_attention_heads=8, attention_head_dim=64,
                      joint_attention_dim=64, pooled_projection_dim=64)}


class _Done:
    def wait(self) -> bool:
        return True


def _local_all_to_all(moved: list):
    def exchange(output, input, *args, async_op=False, **kwargs):
        output.copy_(input)
        moved.append(input.numel() * input.element_size())
        return _Done() if async_op else None
    return exchange


def _setup(family: str, width: int, text: int, seed: int = 0):
    from sp_lab.cli.sampling import make_workload, model_timestep
    from sp_lab.families.synthetic import build_model, family_worker
    config = tiny_config(family, **SIZES[family])
    model, dtypes = build_model(family, config, "float32", torch.device("cpu"), seed=seed)
    worker = family_worker(family, model, config, dtypes)
    info = worker.info
    workload = make_workload(family, info.config, info.in_channels, width, width, text_tokens=text, seed=seed)
    out = torch.empty(info.output_shape(tuple(workload.noise.shape)))
    return worker, workload, model_timestep(family, 0.7, workload.batch), out


def emulated_rank(rank: int, devices: list[str], family: str, width: int, text: int, degree: int, threads: int,
                  repeats: int) -> dict:
    """Spawned single process: rank 0 of `degree` with local all-to-alls; median forward seconds and bytes."""
    import torch.distributed as dist

    from sp_lab.cli.gpu_checks import RankContext
    from sp_runtime.config import SPConfig
    from sp_runtime.groups import ParallelGroups, SeqParallel
    torch.set_num_threads(threads)
    worker, workload, t, out = _setup(family, width, text)
    seq = SeqParallel(ulysses_group=None, ulysses_rank=0, ulysses_degree=degree)
    groups = ParallelGroups(SPConfig(["cpu"] * degree), 0, seq, None, 0, None)
    context = RankContext(torch.device("cpu"), groups)
    moved: list = []
    original = dist.all_to_all_single
    dist.all_to_all_single = _local_all_to_all(moved)
    try:
        times = []
        with torch.inference_mode():
            worker.forward(workload.noise, t, workload.conditioning, out, context)  # warm-up
            calls = len(moved)
            for _ in range(repeats):
                times.append(_timed_forward(worker, workload, t, out, context))
    finally:
        dist.all_to_all_single = original
    return {"seconds": [wall for wall, _ in times], "cpu_seconds": [cpu for _, cpu in times],
            "all_to_all_buffers": moved[:calls], "tokens": workload.tokens}


def _timed_forward(worker, workload, t, out, context) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one forward: CPU time does not count waiting for the cores
    other processes hold, so it compares the work of a rank on a busy machine."""
    wall, cpu = time.perf_counter(), time.process_time()
    worker.forward(workload.noise, t, workload.conditioning, out, context)
    return time.perf_counter() - wall, time.process_time() - cpu


def real_rank(rank: int, devices: list[str], family: str, width: int, text: int, repeats: int) -> list[tuple]:
    """Spawned gloo rank of a real Ulysses-P forward: per repeat, (wall seconds from a common barrier to this rank's
    end, CPU seconds)."""
    import torch.distributed as dist

    from sp_lab.cli.gpu_checks import RankContext
    from sp_runtime.config import SPConfig
    from sp_runtime.groups import build_groups
    worker, workload, t, out = _setup(family, width, text)
    context = RankContext(torch.device("cpu"), build_groups(SPConfig(["cpu"] * len(devices))))
    times = []
    with torch.inference_mode():
        worker.forward(workload.noise, t, workload.conditioning, out, context)
        for _ in range(repeats):
            dist.barrier()
            times.append(_timed_forward(worker, workload, t, out, context))
    return times


def exchange_seconds(buffers: list[int], sweep: list[dict]) -> float:
    return sum(transfer_seconds(size, sweep) for size in buffers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(SIZES), default="qwen_image")
    parser.add_argument("--width", type=int, default=768, help="image side in pixels (768: 2304 tokens)")
    parser.add_argument("--text", type=int, default=32)
    parser.add_argument("--degrees", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=3, help="alternations of emulated and real runs")
    parser.add_argument("--repeats", type=int, default=2, help="timed forwards per run")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "rank_emulation_cpu.json"))
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    monitor = LoadMonitor()
    result = {"machine": describe_machine(), "family": args.family, "size": SIZES[args.family],
              "width": args.width, "text_tokens": args.text, "how": __doc__.split("\n\n")[1].replace("\n", " "),
              "degrees": {}}
    for degree in args.degrees:
        threads = max(1, cores // degree)  # what run_ranks gives each real rank
        sweep_sizes = [2 ** 14, 2 ** 17, 2 ** 20, 2 ** 22, 2 ** 24]
        sweep = [max(rows, key=lambda row: row["seconds"]) for rows in
                 zip(*run_ranks(all_to_all_sweep, ["cpu"] * degree, sweep_sizes, 3, timeout=300))]
        emulated, real, emulated_cpu, real_cpu, loads, buffers = [], [], [], [], [], []
        for _ in range(args.rounds):
            loads.append(load_average())
            row = run_ranks(emulated_rank, ["cpu"], args.family, args.width, args.text, degree, threads,
                            args.repeats, timeout=900)[0]
            emulated += row["seconds"]
            emulated_cpu += row["cpu_seconds"]
            buffers = row["all_to_all_buffers"]
            per_rank = run_ranks(real_rank, ["cpu"] * degree, args.family, args.width, args.text, args.repeats,
                                 timeout=900)
            real += [max(wall for wall, _ in ranks) for ranks in zip(*per_rank)]
            real_cpu += [statistics.median(cpu for _, cpu in ranks) for ranks in zip(*per_rank)]
            print(f"u{degree}: emulated {statistics.median(row['seconds']):.3f} s, real "
                  f"{statistics.median(real[-args.repeats:]):.3f} s (load {loads[-1]})", flush=True)
        share = max(1.0, degree * threads / cores)
        compute = statistics.median(emulated) * share
        exchange = exchange_seconds(buffers, sweep)
        predicted = compute + exchange
        measured = statistics.median(real)
        result["degrees"][f"u{degree}"] = {
            "threads_per_rank": threads, "core_share_factor": share, "emulated_rank_s": emulated,
            "real_step_s": real, "emulated_rank_cpu_s": emulated_cpu, "real_rank_cpu_s": real_cpu,
            "cpu_time_ratio_real_over_emulated": round(statistics.median(real_cpu) / statistics.median(emulated_cpu),
                                                       4),
            "all_to_all_calls": len(buffers), "all_to_all_buffer_bytes": sum(buffers),
            "link_sweep": sweep, "predicted_compute_s": round(compute, 4),
            "predicted_exchange_s": round(exchange, 4), "predicted_step_s": round(predicted, 4),
            "measured_step_s_median": round(measured, 4), "error": round(predicted / measured - 1, 4),
            "load_average_at_rounds": loads}
        print(f"u{degree}: predicted {predicted:.3f} s (compute {compute:.3f} + exchange {exchange:.3f}) vs real "
              f"{measured:.3f} s: {predicted / measured - 1:+.1%}; CPU seconds of a rank: emulated "
              f"{statistics.median(emulated_cpu):.3f}, real {statistics.median(real_cpu):.3f}", flush=True)
    result["machine_load"] = monitor.finish()
    write_json(args.out, result, say=True)


if __name__ == "__main__":
    main()
