"""Where a world-1 step spends its time: our family forward vs diffusers' stock forward on the same random weights,
one call each under torch.profiler, top kernels by device time (CUDA) or CPU time. Finds the cost of our SP
plumbing (rotary, joint text handling, output unpatchify) when no exchange runs.

    python benchmarks/profile_world1.py --family qwen_image --blocks 6 --width 1328 --height 1328 --out prof.json
"""
from __future__ import annotations

import argparse
import statistics

import torch

from sp_lab.cli.gpu_checks import RankContext
from sp_runtime.cli.linkprobe import run_ranks
from sp_runtime.cli.machine import device_sync, timings, write_json
from sp_runtime.cli.model_shapes import FLUX_12B, QWEN_IMAGE_20B

CONFIGS = {"flux": (FLUX_12B, {"num_layers": 1, "num_single_layers": 2}, 512),
           "qwen_image": (QWEN_IMAGE_20B, {"num_layers": 3}, 256)}


def profile_rank(rank: int, devices: list[str], family: str, blocks: int, width: int, height: int,
                 steps: int, top: int) -> dict:
    from sp_lab.cli.diffusers_cp import native_inputs
    from sp_lab.cli.sampling import make_workload, model_timestep
    from sp_runtime.config import SPConfig
    from sp_lab.families.synthetic import build_model, family_worker
    from sp_runtime.groups import build_groups
    device = torch.device(devices[rank])
    base, scaled, text_tokens = CONFIGS[family]
    config = dict(base, **{key: value * blocks for key, value in scaled.items()})
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    model = build_model(family, config, dtype, device, seed=0)[0]  # stock processors, for diffusers' forward
    sp_model, dtypes = build_model(family, config, dtype, device, seed=0)
    worker = family_worker(family, sp_model, config, dtypes)
    workload = make_workload(family, worker.info.config, worker.info.in_channels, width, height,
                             text_tokens=text_tokens)
    t = model_timestep(family, 0.7, workload.batch)
    context = RankContext(device, build_groups(SPConfig(["cpu"])))
    out = torch.empty(worker.info.output_shape(tuple(workload.noise.shape)))
    native = native_inputs(family, model, workload.noise, workload.conditioning, device)
    calls = {"ours": lambda: worker.forward(workload.noise, t, workload.conditioning, out, context),
             "diffusers": lambda: model(**native, return_dict=False)}
    sync = device_sync(device)
    result = {"family": family, "config": config, "tokens": workload.tokens, "text_tokens": text_tokens,
              "device": str(device)}
    with torch.inference_mode():
        for name, call in calls.items():
            result[f"{name}_ms"] = statistics.median(timings(call, steps, warmups=2, sync=sync)) * 1e3
            result[f"{name}_top"] = _profile(call, sync, device, top)
    return result


def _profile(call, sync, device: torch.device, top: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        call()
        if sync is not None:
            sync()
    key = "device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:top]
    return [{"name": e.key[:90], "calls": e.count, "ms": round(getattr(e, key) / 1e3, 3)} for e in events]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(CONFIGS), default="qwen_image")
    parser.add_argument("--blocks", type=int, default=2, help="multiplier of the preset's few blocks")
    parser.add_argument("--width", type=int, default=1328)
    parser.add_argument("--height", type=int, default=1328)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = run_ranks(profile_rank, [args.device], args.family, args.blocks, args.width, args.height, args.steps,
                       args.top, timeout=600)[0]
    print(f"{args.family}: ours {result['ours_ms']:.2f} ms, diffusers {result['diffusers_ms']:.2f} ms "
          f"(ours / diffusers {result['ours_ms'] / result['diffusers_ms']:.3f})")
    for name in ("ours", "diffusers"):
        print(f"-- {name}")
        for row in result[f"{name}_top"]:
            print(f"{row['ms']:9.3f} ms {row['calls']:5d}  {row['name']}")
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
