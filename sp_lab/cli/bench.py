"""`python -m sp_lab bench`: step latency, speed-up, efficiency, per-rank memory and communication per layout.

One run measures every layout (`1`, `u2`, `u4`, `r2`, `u2r2`, `u2cfg2`, ...) on the same model and inputs: a pool
per layout, warm-up calls, then timed calls of diffusion_model (the pool's host-side wall time per call). Each
layout's output is compared with layout 1's. Communication: bytes per step from the model shape (sp_runtime.cli.comm)
and its time share from the same exchanges timed alone on the layout's devices and groups (no overlap assumed).
Writes a JSON report and a PNG plot of speed-up against the number of devices, with the ideal line.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional

import torch

from sp_runtime.config import SPConfig
from sp_runtime.cli.comm import AttentionShape, bytes_per_step, step_exchanges
from sp_runtime.cli.machine import (DEFAULT_CPU_WORKERS, LoadMonitor, command_line, describe_machine, hardware_label,
                      parse_devices, time_summary, tolerance_for, write_json)
from .presets import CACHE_DIR, PRESETS, Preset, get_preset, materialize, parameter_count
from .sampling import Workload, make_workload, model_timestep


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", default=None, help=f"model size preset (default: demo on CPUs, demo-gpu on "
                                                       f"GPUs); one of {', '.join(PRESETS)}")
    source.add_argument("--checkpoint", default=None, help="a Qwen-Image / Flux / Wan checkpoint (.safetensors or a "
                                                           "diffusers folder) instead of a preset")
    parser.add_argument("--layouts", default=None,
                        help="comma-separated layouts, e.g. 1,u2,u4,r2,u2r2,u2cfg2 (default: 1 and u2, u4, u8 up "
                             "to the device count); 1 is always measured, as the baseline")
    parser.add_argument("--devices", default=None, help="e.g. 0,1,2,3, 0-3 or cpu:2 (default: every "
                                                        "GPU, else 2 CPU workers)")
    parser.add_argument("--cpu-workers", type=int, default=DEFAULT_CPU_WORKERS)
    parser.add_argument("--width", type=int, default=None, help="image width in pixels (default: the preset's)")
    parser.add_argument("--height", type=int, default=None, help="image height in pixels (default: the preset's)")
    parser.add_argument("--frames", type=int, default=None, help="video frames (Wan)")
    parser.add_argument("--text-tokens", type=int, default=None, help="text tokens (default: the preset's)")
    parser.add_argument("--batch", type=int, default=None,
                        help="batch per call (default: 2 = cond + uncond when a layout has CFG, else 1)")
    parser.add_argument("--steps", type=int, default=5, help="timed calls per layout (default: 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls first (default: 1)")
    parser.add_argument("--dtype", default="default",
                        help="weight dtype: default (the preset's / the file's), float32, bfloat16, float16, "
                             "fp8_e4m3fn")
    parser.add_argument("--random-init", action="store_true",
                        help="draw a preset's weights on the workers instead of writing a checkpoint")
    parser.add_argument("--exchange-repeats", type=int, default=5,
                        help="repeats when timing the exchanges alone (0: skip the time share)")
    parser.add_argument("--compare-diffusers", action="store_true",
                        help="also time diffusers' built-in context parallel (Ulysses) on the same weights "
                             "(needs GPUs)")
    parser.add_argument("--attention", default="sdpa", help="attention backend load option: sdpa (default), auto, "
                                                              "flash, flash2, flash3, sage")
    parser.add_argument("--fp8-exchange", action="store_true", help="load option: fp8 Ulysses all-to-alls")
    parser.add_argument("--overlap", action="store_true", help="load option: overlap the output exchange")
    parser.add_argument("--compile", action="store_true",
                        help="load option: torch.compile the blocks (the warm-up calls compile; use --warmup >= 1)")
    parser.add_argument("--shard-weights", action="store_true",
                        help="load option: each rank keeps 1/N of every block, gathered per block at each step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join("out", "bench.json"),
                        help="JSON report path; the plot goes next to it as .png (default: out/bench.json)")
    parser.add_argument("--cache-dir", default=CACHE_DIR)


def say(text: str = "", end: str = "\n") -> None:
    print(text, end=end, flush=True)


def run(args) -> int:
    try:
        plan = _Plan.from_args(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"bench: {error}", file=sys.stderr)
        return 2
    return _Bench(args, plan).run()


class _Plan:
    """The validated request: devices, layouts (baseline first), model source and workload sizes."""

    def __init__(self, devices, configs, preset, checkpoint, batch):
        self.devices: list[str] = devices
        self.configs: list[SPConfig] = configs
        self.preset: Optional[Preset] = preset
        self.checkpoint: Optional[str] = checkpoint
        self.batch: int = batch

    @classmethod
    def from_args(cls, args) -> "_Plan":
        for name in ("steps", "warmup", "exchange_repeats"):
            if getattr(args, name) < (1 if name == "steps" else 0):
                raise ValueError(f"--{name.replace('_', '-')} must be at least {1 if name == 'steps' else 0}")
        devices = parse_devices(args.devices, args.cpu_workers)
        names = [n.strip() for n in (args.layouts or default_layouts(len(devices))).split(",") if n.strip()]
        configs = []
        for name in ["1"] + [n for n in names if n != "1"]:
            configs.append(layout_config(devices, name))
        if len({c.layout_name for c in configs}) < len(configs):
            raise ValueError(f"--layouts lists a layout twice: {names}")
        checkpoint = None
        preset = None
        if args.checkpoint:
            checkpoint = os.path.abspath(args.checkpoint)
            if not os.path.exists(checkpoint):
                raise FileNotFoundError(f"--checkpoint {args.checkpoint!r} does not exist")
        else:
            preset = get_preset(args.preset or ("demo-gpu" if devices[0].startswith("cuda") else "demo"))
        batch = args.batch or (2 if any(c.cfg_degree > 1 for c in configs) else 1)
        if batch < 1:
            raise ValueError(f"--batch must be at least 1, got {batch}")
        return cls(devices, configs, preset, checkpoint, batch)


def load_options(args) -> dict:
    """The model load options the bench was asked for (sp_runtime.attention.options), defaults left out."""
    options = {"attention": args.attention, "fp8_exchange": args.fp8_exchange, "overlap": args.overlap,
               "compile": args.compile, "shard_weights": args.shard_weights}
    return {key: value for key, value in options.items() if value not in (False, "sdpa")}


def default_layouts(device_count: int) -> str:
    layouts, degree = ["1"], 2
    while degree <= device_count:
        layouts.append(f"u{degree}")
        degree *= 2
    return ",".join(layouts)


def layout_config(devices: list[str], name: str) -> SPConfig:
    """SPConfig of a layout name on the first devices it needs; errors name the layout and the devices."""
    try:
        config = SPConfig.from_layout(devices, name)
    except ValueError as error:
        raise ValueError(f"layout {name!r} is impossible on {len(devices)} devices {devices}: {error}") from None
    return config


class _Bench:
    def __init__(self, args, plan: _Plan):
        self.args, self.plan = args, plan
        self.workload: Optional[Workload] = None
        self.info = None
        self.baseline_output: Optional[torch.Tensor] = None
        self.report: dict = {"command": command_line("python -m sp_lab bench", args)}
        self.monitor = LoadMonitor()

    def run(self) -> int:
        plan = self.plan
        try:
            path = self._model_path()
        except (ValueError, MemoryError) as error:
            print(f"bench: {error}", file=sys.stderr)
            return 2
        rows = []
        for config in plan.configs:
            row = self._measure_layout(config, path)
            rows.append(row)
            if "error" in rows[0]:  # the baseline could not run: nothing to compare with
                break
        self._finish(rows)
        return 0 if rows and all(row.get("ok") for row in rows) else 1

    # ---- model --------------------------------------------------------------------------------------------------
    def _model_path(self) -> str:
        plan, args = self.plan, self.args
        if plan.checkpoint:
            say(f"bench: checkpoint {plan.checkpoint}")
            return plan.checkpoint
        preset = plan.preset
        synthetic = preset.synthetic or args.random_init
        _check_memory(preset, plan.configs, args.dtype)
        say(f"bench: preset {preset.name} ({preset.description}); "
            f"{'weights drawn on the workers' if synthetic else 'checkpoint'} ", end="")
        path = materialize(preset, args.cache_dir, synthetic=synthetic, seed=args.seed)
        say(os.path.relpath(path))
        return path

    def _make_workload(self, info) -> Workload:
        preset, args = self.plan.preset, self.args
        width = args.width or (preset.width if preset else 1024)
        height = args.height or (preset.height if preset else 1024)
        frames = args.frames or (preset.frames if preset else 81 if info.family == "wan" else 1)
        text = args.text_tokens or (preset.text_tokens if preset else 512 if info.family != "qwen_image" else 256)
        return make_workload(info.family, info.config, info.in_channels, width, height, frames, self.plan.batch,
                             text, seed=args.seed)

    # ---- one layout ---------------------------------------------------------------------------------------------
    def _measure_layout(self, config: SPConfig, path: str) -> dict:
        from sp_runtime.pool import WorkerPool
        row = {"layout": config.layout_name, "world_size": config.world_size,
               "ulysses_degree": config.ulysses_degree, "ring_degree": config.ring_degree,
               "cfg_degree": config.cfg_degree, "devices": list(config.devices), "ok": False}
        say(f"[{config.layout_name}] starting {config.world_size} worker(s) ... ", end="")
        try:
            started = time.perf_counter()
            with WorkerPool(config) as pool:
                row["pool_start_s"] = round(time.perf_counter() - started, 3)
                started = time.perf_counter()
                handle = pool.load_model(path, self.args.dtype, **load_options(self.args))
                row["load_s"] = round(time.perf_counter() - started, 3)
                say(f"started in {row['pool_start_s']:.1f} s, loaded in {row['load_s']:.1f} s; ", end="")
                if self.workload is None:
                    self.info, self.workload = handle.info, self._make_workload(handle.info)
                self._time_calls(pool, handle, row)
        except Exception as error:  # noqa: BLE001 - one layout failing must not lose the others' numbers
            row["error"] = f"{type(error).__name__}: {error}"
            say(f"FAILED: {row['error'].splitlines()[0]}")
            return row
        row.update(self._exchange_times(config, row))
        say(self._row_line(row))
        return row

    def _time_calls(self, pool, handle, row: dict) -> None:
        workload = self.workload
        t = model_timestep(workload.family, 0.7, workload.batch)
        warmups = []
        for _ in range(self.args.warmup):
            handle(workload.noise, t, **workload.conditioning)
            warmups.append(pool.stats["last_call_s"])
        reset_cpu_peaks(pool)
        steps, worker_steps, output = [], [], None
        for _ in range(self.args.steps):
            result = handle(workload.noise, t, **workload.conditioning)
            output = result if output is None else output
            steps.append(pool.stats["last_call_s"])  # the pool's own host-side wall time of the call
            worker_steps.append(pool.stats["last_worker_s"])
        row["memory"] = _rank_memory(pool)
        row.update(warmup_ms=[round(s * 1e3, 3) for s in warmups], step_ms=[round(s * 1e3, 3) for s in steps],
                   slowest_worker_step_ms=[round(s * 1e3, 3) for s in worker_steps], step=time_summary(steps))
        self._compare(output, row)

    def _compare(self, output: torch.Tensor, row: dict) -> None:
        if self.baseline_output is None:
            self.baseline_output = output
        scale = max(1.0, float(self.baseline_output.abs().max()))
        difference = float((output.float() - self.baseline_output.float()).abs().max())
        tolerance = tolerance_for(self.info.compute_dtype)
        row.update(max_abs_difference_vs_1=difference, output_scale=scale, tolerance=tolerance,
                   within_tolerance=difference <= tolerance * scale)
        row["ok"] = row["within_tolerance"]

    def _exchange_times(self, config: SPConfig, row: dict) -> dict:
        shape = AttentionShape.of(self.info.family, self.info.config)
        exchanges = step_exchanges(shape, config, self.workload.tokens, self.workload.text_tokens,
                                   self.workload.batch)
        dtype = self.info.compute_dtype
        result = {"comm_bytes_per_step": bytes_per_step(exchanges, dtype),
                  "all_to_all_bytes_per_step": bytes_per_step([e for e in exchanges if e.kind == "all_to_all"],
                                                              dtype),
                  "exchanges": [{"name": e.name, "kind": e.kind, "elements_per_call": e.elements,
                                 "calls_per_step": e.calls, "bytes_per_step": e.bytes_sent(_size(dtype))}
                                for e in exchanges]}
        if not exchanges or self.args.exchange_repeats == 0:
            result.update(comm_ms_per_step=0.0 if not exchanges else None, comm_share=0.0 if not exchanges else None)
            return result
        from sp_runtime.cli.linkprobe import exchange_times, run_ranks
        try:
            per_rank = run_ranks(exchange_times, list(config.devices), config.to_dict(), self.workload.batch,
                                 [e.__dict__ for e in exchanges], dtype, self.args.exchange_repeats)
        except (RuntimeError, TimeoutError) as error:
            result["comm_error"] = str(error).splitlines()[-1]
            return result
        slowest = [max(times[index] for times in per_rank) for index in range(len(exchanges))]
        step_s = row["step"]["median_ms"] / 1e3
        comm_s, all_to_all_s = 0.0, 0.0
        for entry, exchange, seconds in zip(result["exchanges"], exchanges, slowest):
            entry["ms_per_call"] = round(seconds * 1e3, 4)
            entry["ms_per_step"] = round(seconds * exchange.calls * 1e3, 3)
            comm_s += seconds * exchange.calls
            all_to_all_s += seconds * exchange.calls if exchange.kind == "all_to_all" else 0.0
        result.update(comm_ms_per_step=round(comm_s * 1e3, 3), comm_share=round(comm_s / step_s, 4),
                      all_to_all_ms_per_step=round(all_to_all_s * 1e3, 3),
                      all_to_all_share=round(all_to_all_s / step_s, 4))
        return result

    def _row_line(self, row: dict) -> str:
        text = f"median {row['step']['median_ms']:.1f} ms/step (spread {row['step']['min_ms']:.1f}-" \
               f"{row['step']['max_ms']:.1f})"
        if row["world_size"] > 1 and not row["exchanges"]:
            text += ", no exchanges (CFG halves run apart)"
        elif row.get("comm_share") is not None and row["world_size"] > 1:
            text += f", exchanges {row['comm_bytes_per_step'] / 2**20:.1f} MiB/step, {row['comm_share']:.0%} of " \
                    f"the step (timed alone)"
        text += f", max diff vs 1: {row['max_abs_difference_vs_1']:.2e}"
        return text + ("" if row["within_tolerance"] else " ABOVE TOLERANCE")

    # ---- report -------------------------------------------------------------------------------------------------
    def _finish(self, rows: list[dict]) -> None:
        baseline = rows[0].get("step", {}).get("median_ms") if rows else None
        for row in rows:
            if baseline and "step" in row:
                row["speedup"] = round(baseline / row["step"]["median_ms"], 4)
                row["efficiency"] = round(row["speedup"] / row["world_size"], 4)
        report = self.report
        report.update({
            "model": self._model_description(), "workload": self.workload.describe() if self.workload else None,
            "hardware": hardware_label(self.plan.devices), "devices": self.plan.devices,
            "load_options": load_options(self.args),
            "backend": self.plan.configs[0].backend, "steps": self.args.steps, "warmup": self.args.warmup,
            "timing": "pool.stats['last_call_s']: host-side wall time of one diffusion_model call (shared-memory "
                      "copies included); one call = one denoising step",
            "communication": "bytes: computed from the model shape and the layout (busiest rank, sent to other "
                             "ranks); time: the same exchanges with the same buffer sizes timed alone on the "
                             "layout's devices and groups (spawned ranks), so the share assumes no overlap with "
                             "compute (the ring overlaps its shifts with attention, so its share is an upper bound)",
            "layouts": rows, "machine": describe_machine()})
        if self.args.compare_diffusers:
            report["diffusers_context_parallel"] = self._diffusers_side_by_side(rows)
        else:
            report["diffusers_context_parallel"] = {"skipped": "not requested (--compare-diffusers)"}
        report["machine_load"] = self.monitor.finish()  # after the side-by-side, which also times
        path = write_json(self.args.out, report)
        plot = self._plot(rows, os.path.splitext(self.args.out)[0] + ".png")
        self._print_table(rows)
        say(f"wrote {os.path.relpath(path)}" + (f" and {os.path.relpath(plot)}" if plot else ""))
        say(report["machine_load"]["note"])

    def _model_description(self) -> dict:
        info = self.info
        described = {"source": self.plan.checkpoint or f"preset {self.plan.preset.name}"}
        if self.plan.preset:
            described["preset"] = self.plan.preset.description
        if info is not None:
            described.update(family=info.family, variant=info.variant, config=info.config,
                             weight_dtype=info.weight_dtype, compute_dtype=info.compute_dtype)
        return described

    def _plot(self, rows: list[dict], path: str) -> Optional[str]:
        from .plotting import save_speedup_plot
        series: dict[str, list[tuple[int, float]]] = {}
        for row in rows:
            if "speedup" in row and row["world_size"] > 1:
                series.setdefault(_layout_kind(row), [(1, 1.0)]).append((row["world_size"], row["speedup"]))
        if not series:
            return None
        workload = self.workload.describe()
        title = (f"{self.report['model'].get('family')} {self.report['model'].get('source')}: "
                 f"{workload['image_tokens']} tokens, batch {workload['batch']}, "
                 f"{self.info.compute_dtype}; {self.report['hardware']}")
        return save_speedup_plot(series, path, title)

    def _print_table(self, rows: list[dict]) -> None:
        say("")
        say(f"{'layout':<8} {'devices':>7} {'ms/step':>10} {'spread':>15} {'speed-up':>9} {'effic.':>7} "
            f"{'comm MiB':>9} {'comm %':>7} {'max diff':>9}")
        for row in rows:
            if "error" in row:
                say(f"{row['layout']:<8} {row['world_size']:>7}  failed: {row['error'].splitlines()[0][:80]}")
                continue
            step = row["step"]
            share = row.get("comm_share")
            say(f"{row['layout']:<8} {row['world_size']:>7} {step['median_ms']:>10.1f} "
                f"{step['min_ms']:>7.1f}-{step['max_ms']:<7.1f} {row.get('speedup', 0):>8.2f}x "
                f"{row.get('efficiency', 0):>6.0%} {row['comm_bytes_per_step'] / 2**20:>9.2f} "
                f"{'' if share is None else f'{share:.0%}':>7} {row['max_abs_difference_vs_1']:>9.1e}")

    def _diffusers_side_by_side(self, rows: list[dict]) -> dict:
        from .diffusers_cp import side_by_side
        return side_by_side(self.plan, self.info, self.workload, self.args, rows)


def _layout_kind(row: dict) -> str:
    parts = []
    if row["ulysses_degree"] > 1:
        parts.append("ulysses")
    if row["ring_degree"] > 1:
        parts.append("ring")
    if row["cfg_degree"] > 1:
        parts.append("cfg")
    return " x ".join(parts) or "1"


def _size(dtype: str) -> int:
    from sp_runtime.cli.comm import DTYPE_BYTES
    return DTYPE_BYTES.get(dtype, 4)


# ---- memory --------------------------------------------------------------------------------------------------------
def reset_cpu_peaks(pool) -> None:
    """Linux: reset each CPU worker's peak RSS (VmHWM) so the peak covers the timed calls only."""
    for rank in pool.status()["ranks"]:
        if rank["device"] == "cpu" and rank["pid"]:
            try:
                with open(f"/proc/{rank['pid']}/clear_refs", "w") as handle:
                    handle.write("5")
            except OSError:
                pass


def _rank_memory(pool) -> list[dict]:
    """Per rank, from pool.status() (the figures the ComfyUI panel shows): CUDA peak / allocated / reserved of the
    last call (reported by the workers), or CPU peak RSS (VmHWM) and RSS."""
    memory = []
    for rank in pool.status()["ranks"]:
        entry = {"rank": rank["rank"], "device": rank["device"]}
        reported = rank.get("memory") or {}
        if rank["device"].startswith("cuda"):
            entry.update(peak_bytes=reported.get("peak"), allocated_bytes=reported.get("allocated"),
                         reserved_bytes=reported.get("reserved"), how="torch.cuda.max_memory_allocated, last call")
        else:
            entry.update(peak_bytes=reported.get("peak"), rss_bytes=reported.get("rss"),
                         how="peak RSS (VmHWM) during the timed calls")
        memory.append(entry)
    return memory


def _check_memory(preset: Preset, configs: list[SPConfig], dtype: str) -> None:
    """Refuse a preset whose weights cannot fit before any worker starts (each rank holds all weights)."""
    from sp_runtime.cli.comm import DTYPE_BYTES
    from sp_runtime.checkpoints.dtypes import dtype_name
    name = preset.dtype if dtype == "default" else dtype_name(dtype)
    needed = parameter_count(preset) * DTYPE_BYTES.get(name, 4)
    devices = max(configs, key=lambda c: c.world_size).devices
    if devices[0].startswith("cuda"):
        available = min(torch.cuda.get_device_properties(int(d.split(":")[1])).total_memory for d in devices)
        where = f"the smallest GPU has {available / 1e9:.1f} GB"
        per_device = needed
    else:
        import psutil
        available = psutil.virtual_memory().available
        where = f"this machine has {available / 1e9:.1f} GB free for {len(devices)} CPU workers"
        per_device = needed * len(devices)
    if per_device > 0.9 * available:
        raise MemoryError(f"preset {preset.name} needs about {needed / 1e9:.1f} GB of {name} weights on every "
                          f"worker but {where}: use a smaller preset (e.g. tiny), fewer CPU workers, or GPUs that "
                          f"can hold the model")
