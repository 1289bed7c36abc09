"""World 1 costs nothing: the pool worker's forward (the family's plan through sp.executor, as the pool runs it) vs
diffusers' stock forward on the same random weights, side by side, for the Flux.1, Qwen-Image, Wan 2.1 and
HunyuanVideo shapes (real head size 128 and widths, few blocks, a token count a CPU core runs in about a second).

Calls alternate (ours, diffusers, diffusers, ours, ...) on one thread; the primary figure is each call's CPU time
(time.thread_time: other processes on a shared machine do not count), wall time second, medians over the rounds.
--profile adds torch.profiler's top operators of one call each.

    python benchmarks/bench_world1.py                      # writes benchmarks/results/world1_cpu.json (+ .png)
    python benchmarks/bench_world1.py --shapes flux --rounds 3 --profile --out /tmp/w1.json
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from sp_runtime.cli.linkprobe import run_ranks
from sp_runtime.cli.machine import device_sync, load_average, write_json
from sp_runtime.cli.model_shapes import FLUX_12B, QWEN_IMAGE_20B, WAN_14B
from sp_runtime.cli.speed_model import HUNYUAN_VIDEO_13B

# family, diffusers config (real widths, few blocks), latent (ComfyUI's x shape, batch 1), text tokens
SHAPES = {
    "flux": ("flux", dict(FLUX_12B, num_layers=1, num_single_layers=1), (1, 16, 48, 48), 128),
    "qwen_image": ("qwen_image", dict(QWEN_IMAGE_20B, num_layers=2), (1, 16, 1, 48, 48), 128),
    "wan": ("wan", dict(WAN_14B, num_layers=1), (1, 16, 2, 32, 32), 128),
    "hunyuan_video": ("hunyuan_video", dict(HUNYUAN_VIDEO_13B, num_layers=1, num_single_layers=1),
                      (1, 16, 2, 32, 32), 128),
}


def bench_rank(rank: int, devices: list[str], shape: str, rounds: int, profile: bool, top: int) -> dict:
    from sp_lab.cli.gpu_checks import RankContext
    from sp_runtime.config import SPConfig
    from sp_runtime.groups import build_groups
    torch.set_num_threads(1)
    device = torch.device(devices[rank])
    family, config, latent, text_tokens = SHAPES[shape]
    dtype = "bfloat16"
    stock, ours = _models(family, config, dtype, device)
    x, t, inputs = _comfy_inputs(family, ours.info.config, latent, text_tokens)
    native = _native_inputs(family, stock, x, t, inputs, device)
    context = RankContext(device, build_groups(SPConfig([devices[rank]])))
    out = torch.empty(ours.info.output_shape(tuple(x.shape)))
    calls = {"ours": lambda: ours.forward(x, t, inputs, out, context),
             "diffusers": lambda: stock(**native, return_dict=False)}
    sync = device_sync(device) or (lambda: None)
    times: dict[str, dict[str, list[float]]] = {name: {"cpu": [], "wall": []} for name in calls}
    with torch.inference_mode():
        for name in calls:  # warm-up: first calls allocate and fill caches
            calls[name](), calls[name]()
        for index in range(rounds):
            order = list(calls) if index % 2 == 0 else list(reversed(calls))
            for name in order:
                sync()
                cpu, wall = time.thread_time(), time.perf_counter()
                calls[name]()
                sync()
                times[name]["cpu"].append(time.thread_time() - cpu)
                times[name]["wall"].append(time.perf_counter() - wall)
        difference = (out.float() - _stock_output(family, calls["diffusers"](), x, out)).abs().max().item()
        profiles = {name: _profile(call, sync, device, top) for name, call in calls.items()} if profile else {}
    medians = {name: {kind: statistics.median(values) * 1e3 for kind, values in kinds.items()}
               for name, kinds in times.items()}
    return {"shape": shape, "family": family, "config": config, "latent": list(latent), "text_tokens": text_tokens,
            "image_tokens": _image_tokens(family, latent), "dtype": dtype, "device": str(device),
            "ours_cpu_ms": medians["ours"]["cpu"], "diffusers_cpu_ms": medians["diffusers"]["cpu"],
            "ours_wall_ms": medians["ours"]["wall"], "diffusers_wall_ms": medians["diffusers"]["wall"],
            "ratio_cpu": medians["ours"]["cpu"] / medians["diffusers"]["cpu"],
            "ratio_wall": medians["ours"]["wall"] / medians["diffusers"]["wall"],
            "max_difference": difference, "output_scale": out.float().abs().max().item(),
            "rounds": {name: {kind: [round(v * 1e3, 2) for v in values] for kind, values in kinds.items()}
                       for name, kinds in times.items()}, "profile": profiles}


def _models(family: str, config: dict, dtype: str, device: torch.device):
    """diffusers' stock model and our worker around a second module tree holding the same parameter tensors."""
    from sp_lab.families.synthetic import build_model, family_worker
    from sp_runtime.checkpoints.loading import build_empty_model
    from sp_runtime.cli.model_shapes import model_class
    stock, dtypes = build_model(family, config, dtype, device, seed=0)
    ours_config = dict(config, image_condition_type="token_replace") if family == "hunyuan_video" else config
    twin = build_empty_model(model_class(family), ours_config, dtypes)
    twin.load_state_dict(stock.state_dict(), assign=True)
    return stock, family_worker(family, twin.eval().requires_grad_(False), ours_config, dtypes)


def _comfy_inputs(family: str, config: dict, latent: tuple, text_tokens: int):
    """ComfyUI's diffusion_model call (x, timestep, inputs), seeded."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(latent, generator=g)
    width = config.get("text_dim") or config.get("joint_attention_dim") or config.get("text_embed_dim") or 4096
    inputs = {"context": torch.randn(latent[0], text_tokens, width, generator=g)}
    if family in ("flux", "hunyuan_video"):
        inputs["y"] = torch.randn(latent[0], 768, generator=g)
        inputs["guidance"] = torch.full((latent[0],), 3.5)
    sigma = 0.7 * (1000.0 if family in ("wan", "hunyuan_video") else 1.0)
    return x, torch.full((latent[0],), sigma), inputs


def _native_inputs(family: str, model, x, t, inputs: dict, device: torch.device) -> dict:
    from sp_lab.cli.diffusers_cp import native_inputs
    if family != "hunyuan_video":
        return native_inputs(family, model, x, inputs, device)
    dtype, batch = model.proj_out.weight.dtype, x.shape[0]
    context = inputs["context"].to(device, dtype)
    return {"hidden_states": x.to(device, dtype), "timestep": t.to(device), "encoder_hidden_states": context,
            "encoder_attention_mask": torch.ones(batch, context.shape[1], device=device),
            "pooled_projections": inputs["y"].to(device, dtype), "guidance": inputs["guidance"].to(device) * 1000}


def _stock_output(family: str, result, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """diffusers' output in ComfyUI's layout (token-packed families unpacked), float32 on the CPU."""
    from sp_runtime.sp.tokens import TokenGrid, reference_unpack
    tensor = result[0]
    if family in ("flux", "qwen_image"):
        tensor = reference_unpack(tensor, TokenGrid.of(*x.shape[-2:], 2)).reshape(out.shape)
    return tensor.float().cpu()


def _image_tokens(family: str, latent: tuple) -> int:
    frames = latent[2] if len(latent) == 5 else 1
    return frames * (latent[-2] // 2) * (latent[-1] // 2)


def _profile(call, sync, device: torch.device, top: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        call()
        sync()
    key = "device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:top]
    return [{"name": e.key[:90], "calls": e.count, "ms": round(getattr(e, key) / 1e3, 3)} for e in events]


def plot(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axis = plt.subplots(figsize=(6, 3))
    names = [r["shape"] for r in results]
    axis.bar(names, [r["ratio_cpu"] for r in results], color="tab:blue", label="CPU time")
    axis.plot(names, [r["ratio_wall"] for r in results], "o", color="tab:orange", label="wall")
    axis.axhline(1.02, color="grey", linestyle="--", linewidth=1, label="target 1.02")
    axis.set_ylim(0.8, 1.2)
    axis.set_ylabel("pool / diffusers, world 1")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {sorted(SHAPES)}")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--profile", action="store_true", help="add torch.profiler's top operators of each forward")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="benchmarks/results/world1_cpu.json")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    results, loads = [], [load_average()]
    for shape in args.shapes.split(","):
        result = run_ranks(bench_rank, [args.device], shape, args.rounds, args.profile, args.top, timeout=1800)[0]
        loads.append(load_average())
        results.append(result)
        print(f"{shape:14s} CPU ours {result['ours_cpu_ms']:8.1f} ms, diffusers {result['diffusers_cpu_ms']:8.1f} ms "
              f"(ours / diffusers {result['ratio_cpu']:.3f}); wall {result['ours_wall_ms']:8.1f} / "
              f"{result['diffusers_wall_ms']:8.1f} ms ({result['ratio_wall']:.3f}); max difference "
              f"{result['max_difference']:.3g} of scale {result['output_scale']:.3g}", flush=True)
        for name, rows in result["profile"].items():
            print(f"  -- {name}")
            for row in rows:
                print(f"  {row['ms']:9.3f} ms {row['calls']:5d}  {row['name']}")
    write_json(args.out, {"threads": 1, "load_average": loads, "results": results}, say=True)
    if not args.no_plot:
        plot(results, args.out.removesuffix(".json") + ".png")


if __name__ == "__main__":
    main()
