"""Tensor parallelism measured on CPU workers and set beside shard_weights and Ulysses: (1) per-rank weight bytes at
TP 2 and 4 against the whole model (the workers' own accounting, as bench_shard_weights.py measures it), on the same
~300 MB Qwen-Image-architecture model, and the TP output against the whole model's; the peak RSS of each rank while
it loads (TP ranks read only their slices) against a whole-model load; (2) bytes each rank sends per
step for TP, shard_weights and Ulysses on 4 devices, from the speed model's exchange list (sp_runtime.cli.comm), for
full-size Qwen-Image at 1328^2 and Wan 14B at 1280x720x81, with the predicted step times on NVLink and PCIe.

Usage: python benchmarks/bench_tp.py [--out benchmarks/results/tp_cpu.json] [--plot-only]
Also writes the figure beside the JSON (tp_cpu.png: per-rank memory and bytes sent per step for each layout);
--plot-only redraws it from the JSON.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sp_runtime import SPConfig, WorkerPool  # noqa: E402
from sp_runtime.cli.machine import LoadMonitor, describe_machine, write_json  # noqa: E402
from sp_runtime.cli.speed_model import Device, Layout, Link, known_shape, predict, video_tokens  # noqa: E402
from sp_lab.cli.presets import Preset, materialize  # noqa: E402
from sp_lab.cli.sampling import make_workload, model_timestep  # noqa: E402

MIB = 2 ** 20
BIG = Preset("tp-300mb", "qwen_image", "Qwen-Image architecture, 8 blocks, 8 heads of 64, fp32 (~300 MB)",
             256, 256, text_tokens=32,
             size=dict(num_layers=8, num_attention_heads=8, attention_head_dim=64, joint_attention_dim=64))
H200 = Device("h200", matmul_flops=700e12, attention_flops=400e12, memory_bytes=141e9)
LINKS = {"nvlink": Link(450e9), "pcie4": Link(25e9)}


def resident(pool) -> list[int]:
    return [rank["weights"]["resident"] for rank in pool.status()["ranks"]]


def run_once(pool, path: str):
    handle = pool.load_model(path, "float32")
    workload = make_workload("qwen_image", handle.info.config, handle.info.in_channels, BIG.width, BIG.height,
                             text_tokens=BIG.text_tokens)
    out = handle(workload.noise, model_timestep("qwen_image", 0.7, 1), **workload.conditioning)
    return out, resident(pool), workload.tokens


def memory(path: str) -> dict:
    with WorkerPool(SPConfig(["cpu"])) as pool:
        whole_out, (whole,), tokens = run_once(pool, path)
    rows = []
    for degree in (2, 4):
        with WorkerPool(SPConfig(["cpu"] * degree, tensor_parallel_degree=degree)) as pool:
            out, per_rank, _ = run_once(pool, path)
        error = float((out - whole_out).abs().max() / max(1.0, float(whole_out.abs().max())))
        ratio = max(per_rank) / whole
        rows.append({"tensor_parallel_degree": degree, "weights_per_rank_bytes": per_rank,
                     "ratio_of_whole": round(ratio, 4), "target": 0.55 if degree == 2 else 0.30,
                     "relative_error_vs_whole": error})
        print(f"TP {degree}: weights per rank {max(per_rank) / MIB:.1f} MiB of {whole / MIB:.1f} MiB "
              f"(x{ratio:.3f}); output vs whole {error:.1e} of scale", flush=True)
    return {"model": BIG.description, "tokens": tokens, "whole_bytes": whole, "tp": rows}


def load_peaks(path: str) -> dict:
    """Peak RSS above the idle worker (VmHWM, from the host) while each rank loads the model: whole at world 1, at
    TP 2 / 4 each rank reading only its slices of the split weights."""
    import tempfile
    from sp_lab.tiny_models import write_tiny_checkpoint
    warm_up = write_tiny_checkpoint("qwen_image", os.path.join(tempfile.mkdtemp(), "tiny.safetensors"), seed=1,
                                    num_attention_heads=8)
    rows = []
    for degree in (1, 2, 4):
        config = SPConfig(["cpu"] * degree, tensor_parallel_degree=degree) if degree > 1 else SPConfig(["cpu"])
        with WorkerPool(config) as pool:
            pool.unload(pool.load_model(warm_up, "float32"))  # diffusers imported: its modules are not the load's
            idle = [rank["memory"]["rss"] for rank in pool.status()["ranks"]]
            pool.load_model(path, "float32")
            ranks = pool.status()["ranks"]
        peaks = [rank["memory"]["peak"] - before for rank, before in zip(ranks, idle)]
        rows.append({"tensor_parallel_degree": degree, "load_peak_rss_above_idle_bytes": peaks,
                     "weights_per_rank_bytes": [rank["weights"]["resident"] for rank in ranks]})
        print(f"load at TP {degree}: peak RSS above idle per rank {max(peaks) / MIB:.1f} MiB", flush=True)
    whole = rows[0]["load_peak_rss_above_idle_bytes"][0]
    for row in rows:
        row["peak_ratio_of_whole_load"] = round(max(row["load_peak_rss_above_idle_bytes"]) / whole, 4)
    return {"model": BIG.description, "how": "pool.status() ranks[r]['memory']: peak (VmHWM) after the load minus "
                                             "rss before it (after a tiny model's load and unload imported diffusers);"
                                             " no forward run", "loads": rows}


def bytes_per_step() -> list[dict]:
    cases = [("qwen-image", "1328x1328", (1328 // 16) ** 2, 512),
             ("wan", "1280x720x81", video_tokens(1280, 720, 81), 512)]
    layouts = {"ulysses 4": Layout(ulysses=4), "shard_weights (u4)": Layout(ulysses=4, shard_weights=True),
               "tp 4": Layout(tp=4), "u2 x tp 2": Layout(ulysses=2, tp=2)}
    found = []
    for model, size, tokens, text in cases:
        shape = known_shape(model)
        for name, layout in layouts.items():
            row = {"model": model, "size": size, "tokens": tokens, "layout": name}
            for link_name, link in LINKS.items():
                prediction = predict(shape, tokens, text, layout, H200, link)
                row["bytes_sent_per_rank"] = prediction.bytes_sent
                row["memory_per_rank_bytes"] = int(prediction.memory_bytes)
                row[f"step_ms_{link_name}"] = round(prediction.step_s * 1e3, 1)
            found.append(row)
            print(f"{model} {size} ({tokens} tokens) {name:<20} {row['bytes_sent_per_rank'] / 1e9:7.2f} GB sent "
                  f"per rank per step; predicted {row['step_ms_nvlink']:.0f} ms NVLink, "
                  f"{row['step_ms_pcie4']:.0f} ms PCIe 4", flush=True)
    return found


def plot(result: dict, path: str) -> None:
    """Bars of per-rank memory and bytes sent per rank per step, by layout, one row of panels per model."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["bytes_per_step"]
    models = list(dict.fromkeys(row["model"] for row in rows))
    figure, axes = plt.subplots(len(models), 2, figsize=(11, 3.2 * len(models)), squeeze=False)
    for line, model in zip(axes, models):
        mine = [row for row in rows if row["model"] == model]
        names = [row["layout"] for row in mine]
        for axis, key, title in ((line[0], "memory_per_rank_bytes", "memory per rank (GB)"),
                                 (line[1], "bytes_sent_per_rank", "bytes sent per rank per step (GB)")):
            axis.barh(names, [row[key] / 1e9 for row in mine], color=["#4c72b0", "#dd8452", "#55a868", "#c44e52"])
            axis.set_title(f"{model} {mine[0]['size']}: {title}", fontsize=9)
            axis.invert_yaxis()
    figure.suptitle("4 devices, speed model's predictions (H200-like, bf16)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    print(f"wrote {path}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "tp_cpu.json"))
    parser.add_argument("--load-only", action="store_true", help="only the load peaks (into --out)")
    parser.add_argument("--plot-only", action="store_true", help="redraw the figure from --out")
    args = parser.parse_args()
    figure = os.path.splitext(args.out)[0] + ".png"
    if args.plot_only:
        import json
        with open(args.out) as handle:
            plot(json.load(handle), figure)
        return
    if args.load_only:
        write_json(args.out, {"machine": describe_machine(), "command": "python benchmarks/bench_tp.py --load-only",
                              "load_peak": load_peaks(materialize(BIG))}, say=True)
        return
    monitor = LoadMonitor()
    result = {"machine": describe_machine(), "command": "python benchmarks/bench_tp.py",
              "how": "weights: pool.status() ranks[r]['weights']['resident'] (the workers' accounting); bytes and "
                     "step times: sp_runtime.cli.speed_model.predict on an H200-like device (700 / 400 TFLOP/s), "
                     "bf16, batch 2 for CFG models, NVLink 450 GB/s and PCIe 4 25 GB/s per direction",
              "memory": memory(materialize(BIG)), "load_peak": load_peaks(materialize(BIG)),
              "bytes_per_step": bytes_per_step()}
    result["machine_load"] = monitor.finish()
    write_json(args.out, result, say=True)
    plot(result, figure)


if __name__ == "__main__":
    main()
