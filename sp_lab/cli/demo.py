"""`python -m sp_lab demo`: a short generation through the worker pool, checked against one device.

On first run it trains a small Qwen-Image-architecture model to draw coloured shapes (about a minute on 2 CPU
cores, demo_training.py) and keeps it as a ComfyUI-layout checkpoint in a cache folder; nothing is downloaded.
Other presets write random-weight models instead. It starts the pool on the local devices (every CUDA GPU, else 2
CPU workers with gloo), runs a few Euler steps of a flow-matching schedule through it, runs the same steps in this
process with diffusers' own forward on one device, and prints the per-step times (the pool's own per-call stats),
the speed-up and the max difference. Exit status 1 when the difference is above the tolerance. Writes a PNG (both
results side by side with their difference) and a JSON summary.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import torch

from sp_runtime.config import SPConfig
from sp_runtime.cli.comm import AttentionShape
from sp_runtime.cli.machine import (DEFAULT_CPU_WORKERS, LoadMonitor, command_line, describe_machine, hardware_label,
                      parse_devices, time_summary, tolerance_for, write_json)
from .presets import CACHE_DIR, PRESETS, Preset, diffusers_config, get_preset, latent_shape, materialize
from .sampling import Workload, euler_loop, flow_sigmas, make_workload

DEFAULT_PRESET = "shapes"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default=None,
                        help=f"model (default: shapes, trained on first run); one of {', '.join(PRESETS)}")
    parser.add_argument("--devices", default=None,
                        help="workers' devices, e.g. cuda:0,cuda:1 or cpu*2 (default: every GPU, else 2 CPU workers)")
    parser.add_argument("--cpu-workers", type=int, default=DEFAULT_CPU_WORKERS,
                        help="CPU workers when there is no GPU (default: 2)")
    parser.add_argument("--layout", default=None, help="parallel layout, e.g. u2, u2r2, r2 (default: Ulysses over "
                                                       "all devices)")
    parser.add_argument("--steps", type=int, default=16, help="Euler steps (default: 16)")
    parser.add_argument("--shift", type=float, default=3.0, help="flow-matching schedule shift (default: 3.0)")
    parser.add_argument("--width", type=int, default=None, help="image width in pixels (default: the preset's)")
    parser.add_argument("--height", type=int, default=None, help="image height in pixels (default: the preset's)")
    parser.add_argument("--frames", type=int, default=None, help="video frames (Wan presets)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=None,
                        help="max |pool - one device| / max(1, max |one device|) (default: 1e-5 fp32, 2e-2 bf16)")
    parser.add_argument("--out", default="out", help="folder for demo.png and demo.json (default: ./out)")
    parser.add_argument("--cache-dir", default=CACHE_DIR, help=f"where the demo checkpoint is kept "
                                                                f"(default: {CACHE_DIR})")


def say(text: str = "", end: str = "\n") -> None:
    print(text, end=end, flush=True)


def run(args) -> int:
    try:
        plan = _plan(args)
    except ValueError as error:
        print(f"demo: {error}", file=sys.stderr)
        return 2
    from sp_runtime.pool import WorkerError
    try:
        return _Demo(args, *plan).run()
    except WorkerError as error:  # start failures, dead workers, errors raised in a worker
        print(f"\ndemo: the worker pool failed: {error}", file=sys.stderr)
        return 1


def _plan(args) -> tuple[SPConfig, Preset]:
    """Validate everything before any process starts: devices, layout, preset, sizes."""
    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    devices = parse_devices(args.devices, args.cpu_workers)
    layout = args.layout or f"u{len(devices)}"
    try:
        config = SPConfig.from_layout(devices, layout)
    except ValueError as error:
        raise ValueError(f"layout {layout!r} does not fit the devices {devices}: {error}") from None
    if config.world_size < len(devices):
        raise ValueError(f"layout {layout!r} uses {config.world_size} of the {len(devices)} devices {devices}; "
                         f"give --devices with exactly the devices to use")
    return config, get_preset(args.preset or DEFAULT_PRESET)


class _Demo:
    def __init__(self, args, config: SPConfig, preset: Preset):
        self.args, self.config, self.preset = args, config, preset
        self.width = args.width or preset.width
        self.height = args.height or preset.height
        self.frames = args.frames or preset.frames
        self.sigmas = flow_sigmas(args.steps, args.shift)
        self.summary: dict = {"command": command_line("python -m sp_lab demo", args)}
        self.monitor = LoadMonitor()

    def run(self) -> int:
        config, preset = self.config, self.preset
        say(f"ulysses-sp demo: {preset.description}, {self.args.steps} Euler steps, layout {config.layout_name} on "
            f"{', '.join(config.devices)} ({config.backend})")
        path = self._checkpoint()
        sp_times, worker_times, sp_result, pool_info = self._through_pool(path)
        one_times, one_result = self._one_device(path, pool_info)
        return self._report(sp_times, worker_times, sp_result, one_times, one_result, pool_info)

    # ---- steps ----------------------------------------------------------------------------------------------
    def _checkpoint(self) -> str:
        started = time.perf_counter()
        say("[1/4] checkpoint: ", end="")
        path = materialize(self.preset, self.args.cache_dir, seed=self.args.seed,
                           training_progress=_training_progress())
        elapsed = time.perf_counter() - started
        made = elapsed > 0.05  # else it was in the cache
        say(f"{os.path.relpath(path)} ({os.path.getsize(path) / 2**20:.1f} MiB"
            f"{f', made in {elapsed:.1f} s' if made else ', cached'})")
        self.summary["checkpoint"] = {"path": os.path.relpath(path), "bytes": os.path.getsize(path),
                                      "seconds": round(elapsed, 3)}
        if self.preset.trained:
            from .demo_training import training_summary
            training = training_summary(path)
            loss = training["loss"]
            say(f"      trained {loss['steps']} steps in {training['seconds']:.0f} s on {training['threads']} "
                f"threads{'' if made else ' (an earlier run)'}: loss {loss['first']:.3f} -> "
                f"{loss['last']:.3f}")
            self.summary["training"] = {**training, "this_run": made}
        return path

    def _through_pool(self, path: str):
        from sp_runtime.pool import WorkerPool
        config = self.config
        say(f"[2/4] starting {config.world_size} workers on {', '.join(config.devices)} ({config.backend}) ... ",
            end="")
        started = time.perf_counter()
        with WorkerPool(config) as pool:
            start_s = time.perf_counter() - started
            say(f"ready in {start_s:.1f} s; loading the model ... ", end="")
            started = time.perf_counter()
            handle = pool.load_model(path, progress=_load_progress())
            load_s = time.perf_counter() - started
            say(f"loaded in {load_s:.1f} s")
            info = handle.info
            workload = self._workload(info.family, info.config, info.in_channels)
            heads = AttentionShape.of(info.family, info.config).heads
            say(f"      latent {list(workload.noise.shape)}: {workload.tokens} image tokens + "
                f"{workload.text_tokens} text tokens, {heads} heads")
            say(f"[3/4] {self.args.steps} steps through the pool ({config.layout_name}):")
            times, worker_times = [], []

            def forward(x, t, conditioning):
                return handle(x, t, **conditioning)

            warm = self._warm_up(forward, workload)
            say(f"      warm-up call {pool.stats['last_call_s'] * 1e3:9.1f} ms (not counted)")

            def on_step(index, sigma, sigma_next, velocity):
                times.append(pool.stats["last_call_s"])  # the pool's host-side wall time of this call
                worker_times.append(pool.stats["last_worker_s"])
                say(f"      step {index + 1:>2}/{self.args.steps}  sigma {sigma:.3f} -> {sigma_next:.3f}  "
                    f"{times[-1] * 1e3:9.1f} ms  (slowest worker {worker_times[-1] * 1e3:.1f} ms)")

            result = euler_loop(forward, workload, self.sigmas, on_step)
            status = pool.status()
        pool_info = {"family": info.family, "variant": info.variant, "config": info.config,
                     "in_channels": info.in_channels, "weight_dtype": info.weight_dtype,
                     "compute_dtype": info.compute_dtype, "start_s": round(start_s, 3), "load_s": round(load_s, 3),
                     "warm_up_ms": round(warm * 1e3, 3), "workload": workload,
                     "ranks": [{"rank": r["rank"], "device": r["device"], "memory": r["memory"]}
                               for r in status["ranks"]]}
        return times, worker_times, result, pool_info

    def _one_device(self, path: str, pool_info: dict):
        device = torch.device(self.config.devices[0])
        family = pool_info["family"]
        if device.type == "cpu":
            torch.set_num_threads(os.cpu_count() or 1)  # one process gets every core, as the workers share them
        threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
        say(f"[4/4] the same {self.args.steps} steps in this process on {device}{threads} "
            f"(diffusers' own forward) ... loading", end="")
        model, reference = _reference_model(self.preset, family, path, device, self.args.seed)
        say("")
        workload: Workload = pool_info["workload"]
        times: list[float] = []

        def forward(x, t, conditioning):
            started = time.perf_counter()
            velocity = reference(model, x, t, **conditioning)  # returns a CPU tensor: the device is synchronised
            times.append(time.perf_counter() - started)
            return velocity

        forward(workload.noise, torch.ones(workload.batch), workload.conditioning)
        say(f"      warm-up call {times.pop() * 1e3:9.1f} ms (not counted)")

        def on_step(index, sigma, sigma_next, velocity):
            say(f"      step {index + 1:>2}/{self.args.steps}  sigma {sigma:.3f} -> {sigma_next:.3f}  "
                f"{times[-1] * 1e3:9.1f} ms")

        result = euler_loop(forward, workload, self.sigmas, on_step)
        return times, result

    def _warm_up(self, forward, workload: Workload) -> float:
        started = time.perf_counter()
        forward(workload.noise, torch.ones(workload.batch), workload.conditioning)
        return time.perf_counter() - started

    def _workload(self, family: str, info_config: dict, in_channels: int) -> Workload:
        if self.preset.trained:  # one picture of every shape in every colour
            from . import shapes
            shape_ids, colour_ids = shapes.class_ids()
            latent = latent_shape(family, in_channels, self.width, self.height, batch=len(shape_ids))
            noise = torch.randn(latent, generator=torch.Generator().manual_seed(self.args.seed))
            context = shapes.context(shape_ids, colour_ids, info_config["joint_attention_dim"])
            return Workload(family, noise, {"context": context}, context.shape[1])
        return make_workload(family, info_config, in_channels, self.width, self.height, self.frames, batch=1,
                             text_tokens=self.preset.text_tokens, seed=self.args.seed)

    # ---- result ---------------------------------------------------------------------------------------------
    def _report(self, sp_times, worker_times, sp_result, one_times, one_result, pool_info) -> int:
        sp, one = time_summary(sp_times), time_summary(one_times)
        speedup = one["median_ms"] / sp["median_ms"]
        difference = float((sp_result - one_result).abs().max())
        scale = max(1.0, float(one_result.abs().max()))
        dtype = pool_info["compute_dtype"]
        tolerance = self.args.tolerance if self.args.tolerance is not None else tolerance_for(dtype)
        passed = difference <= tolerance * scale
        image, picture = self._picture(sp_result, one_result)
        load = self.monitor.finish()
        world = self.config.world_size
        say("")
        say(f"per step (median of {sp['samples']}): pool {self.config.layout_name} {sp['median_ms']:.1f} ms, one "
            f"device {one['median_ms']:.1f} ms -> speed-up {speedup:.2f}x on {world} "
            f"{'devices' if world > 1 else 'device'} ({hardware_label(self.config.devices)})")
        if speedup < 1 and self.config.backend == "gloo":
            say("note: CPU workers share the same cores, so sequence parallelism cannot add compute here; the "
                "demo shows the mechanism and the parity, GPUs show the speed-up")
        say(f"max |pool - one device| = {difference:.3e} (output scale {scale:.3g}, tolerance {tolerance:.0e} x "
            f"scale, {dtype}): {'PASS' if passed else 'FAIL: the pool does not match one device'}")
        self.summary.update({
            "preset": self.preset.name, "model": {key: pool_info[key] for key in
                                                  ("family", "variant", "config", "weight_dtype", "compute_dtype")},
            "workload": pool_info["workload"].describe(), "steps": self.args.steps,
            "sigmas": [round(float(s), 6) for s in self.sigmas], "layout": self.config.layout_name,
            "devices": list(self.config.devices), "backend": self.config.backend,
            "hardware": hardware_label(self.config.devices),
            "pool": {"start_s": pool_info["start_s"], "load_s": pool_info["load_s"],
                     "warm_up_ms": pool_info["warm_up_ms"], "ranks": pool_info["ranks"]},
            "step_ms": {"pool": [round(t * 1e3, 3) for t in sp_times],
                        "pool_slowest_worker": [round(t * 1e3, 3) for t in worker_times],
                        "one_device": [round(t * 1e3, 3) for t in one_times]},
            "pool_step": sp, "one_device_step": one, "speedup": round(speedup, 4),
            "max_abs_difference": difference, "output_scale": scale, "tolerance": tolerance,
            "tolerance_abs": tolerance * scale, "passed": passed, "image": os.path.relpath(image), **picture,
            "one_device": {"device": self.config.devices[0], "how": "diffusers' own forward, in this process"},
            "machine_load": load,
            "machine": describe_machine()})
        summary_path = write_json(os.path.join(self.args.out, "demo.json"), self.summary)
        say(f"wrote {os.path.relpath(image)} ({picture['shows']}) and {os.path.relpath(summary_path)}")
        say(load["note"])
        return 0 if passed else 1

    def _picture(self, sp_result: torch.Tensor, one_result: torch.Tensor) -> tuple[str, dict]:
        """demo.png: the pool's and one device's pictures side by side, and their difference amplified."""
        from .plotting import latent_pictures, save_comparison_png
        if self.preset.trained:
            from . import shapes
            pictures = shapes.pictures
            shown = {"shows": "a picture of every shape and colour, through the demo's pixel-unshuffle \"VAE\"",
                     "samples": [f"{colour} {shape}" for shape, colour in shapes.classes()]}
        else:
            pictures = latent_pictures
            shown = {"shows": "latent channels 1-3 as RGB (random weights)"}
        difference = (sp_result - one_result).abs().amax(dim=1)
        difference = difference[:, 0] if difference.dim() == 4 else difference  # first frame
        path = os.path.join(self.args.out, "demo.png")
        workers = f"{self.config.world_size} {'CPU workers' if self.config.backend == 'gloo' else 'GPUs'}"
        titles = (f"through the pool ({self.config.layout_name}, {workers})", f"one device ({self.config.devices[0]})")
        return path, {**shown, **save_comparison_png(pictures(sp_result), pictures(one_result), difference, path,
                                                     titles, columns=4)}


def _reference_model(preset: Preset, family: str, path: str, device: torch.device, seed: int):
    """The model on one device in this process, and its family's single-process reference forward."""
    from sp_runtime.families import family as registered

    from ..references import reference_forward
    if preset.synthetic:
        from ..families.synthetic import build_model
        model, _ = build_model(family, diffusers_config(preset), preset.dtype, device, seed)
    else:
        model = registered(family).load_model(path, "default", device)[0]
    return model, reference_forward(family)


def _training_progress():
    shown = [-1]

    def progress(step: int, steps: int, loss: float) -> None:
        if shown[0] < 0:
            say(f"training the demo model, {steps} steps (first run only) ... ", end="")
        percent = step * 100 // steps // 10 * 10
        if percent > shown[0]:
            shown[0] = percent
            say(f"{percent}% ", end="" if step < steps else "\n      ")
    return progress


def _load_progress():
    shown = [-1]

    def progress(fraction: float, message: str) -> None:
        percent = int(fraction * 100) // 25 * 25
        if percent > shown[0] and sys.stdout.isatty():
            shown[0] = percent
            say(f"{percent}% ", end="")
    return progress
