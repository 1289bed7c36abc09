"""`python -m sp_lab gpu-suite`: everything this project needs measured on a CUDA machine, in one command that
stops within a time budget. Sections run in order, each on its own (a failing one is recorded and the next runs),
and the JSON report is rewritten after each, so an interrupted run keeps what it measured. A section whose
estimated time no longer fits the budget is skipped with that reason.

Sections: environment (GPUs, driver, CUDA, torch, NCCL, P2P); correctness at world 1 (pool vs single-process
diffusers, fp32 and bf16); attention parity of Ulysses / ring / hybrid against plain SDPA (NCCL across GPUs, or
gloo ranks sharing one GPU), with FP8 exchange and overlap variants; FP8 exchange error and bytes; all-to-all
bandwidth per message size, plain and FP8; with 2+ GPUs the layouts' parity through the pool (bench); full-size
random-weight Flux.1-dev and Qwen-Image step times through the pool vs diffusers in one process (and diffusers'
context parallel with 2+ GPUs); compiled vs eager model calls; stock ComfyUI vs the pool at world 1 on the same
bf16 / fp8 / int8 files (with COMFYUI_PATH). Without CUDA it refuses, unless --allow-cpu (tests).
"""
from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import traceback
from typing import Callable, Optional

import torch

from sp_runtime.cli.machine import LoadMonitor, command_line, describe_machine, hardware_label, write_json

DEFAULT_BUDGET_S = 480
HARD_STOP_GRACE_S = 60  # past budget + grace the suite kills its children and exits (the JSON is already written)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None, help="folder for the results (default: "
                                                    "benchmarks/results/gpu_<gpu name>/)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"stop starting sections whose estimated time does not fit in this many seconds from "
                             f"the start (default: {DEFAULT_BUDGET_S})")
    parser.add_argument("--sections", default=None,
                        help=f"comma-separated sections to run (default: all): {', '.join(SECTION_NAMES)}")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="without CUDA, run the sections on CPU workers with tiny sizes (tests)")
    parser.add_argument("--full-blocks", action="store_true",
                        help="never reduce the full-size models' blocks to fit the budget")


def run(args) -> int:
    cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if not cuda and not args.allow_cpu:
        print(f"gpu-suite: no CUDA device is visible (torch {torch.__version__}, built for CUDA "
              f"{torch.version.cuda or 'none'}): run it on a machine with an NVIDIA GPU, or pass --allow-cpu to run "
              f"its CPU-safe parts with tiny sizes", file=sys.stderr)
        return 2
    try:
        selected = _selected(args.sections)
        if args.budget_s <= 0:
            raise ValueError(f"--budget-s must be positive, got {args.budget_s}")
    except ValueError as error:
        print(f"gpu-suite: {error}", file=sys.stderr)
        return 2
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if cuda else ["cpu", "cpu"]
    return Suite(args, devices, selected).run()


def _selected(text: Optional[str]) -> list[str]:
    if not text:
        return list(SECTION_NAMES)
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SECTION_NAMES]
    if unknown:
        raise ValueError(f"--sections: unknown {unknown}; sections are {', '.join(SECTION_NAMES)}")
    return names


def default_out(devices: list[str]) -> str:
    if devices[0].startswith("cuda"):
        name = torch.cuda.get_device_properties(0).name
        label = f"gpu_{re.sub(r'[^a-z0-9]+', '_', name.lower()).strip('_')}"
        if len(devices) > 1:
            label += f"_x{len(devices)}"
    else:
        label = "gpu_suite_cpu"
    return os.path.join("benchmarks", "results", label)


class Suite:
    def __init__(self, args, devices: list[str], selected: list[str]):
        self.args, self.devices, self.selected = args, devices, selected
        self.cuda = devices[0].startswith("cuda")
        self.out = args.out or default_out(devices)
        self.path = os.path.join(self.out, "gpu_suite.json")
        self.started = time.monotonic()
        self.scratch = tempfile.mkdtemp(prefix="usp_gpu_suite_")
        self.report = {"command": command_line("python -m sp_lab gpu-suite", args), "hardware": hardware_label(devices),
                       "devices": devices, "budget_s": args.budget_s,
                       "sizes": "full" if self.cuda else "tiny (CPU run: plumbing only, no GPU figure)",
                       "sections": {}}
        self.running: Optional[str] = None
        self.monitor = LoadMonitor()

    @property
    def gpus(self) -> int:
        return len(self.devices) if self.cuda else 0

    def left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.started)

    def run(self) -> int:
        os.makedirs(self.out, exist_ok=True)
        stop = threading.Timer(self.args.budget_s + HARD_STOP_GRACE_S, self._hard_stop)
        stop.daemon = True
        stop.start()
        try:
            for name, (estimate, section) in SECTIONS.items():
                if name in self.selected:
                    self._run_section(name, estimate, section)
        finally:
            stop.cancel()
            shutil.rmtree(self.scratch, ignore_errors=True)
        self.report["seconds"] = round(time.monotonic() - self.started, 1)
        self.report["machine_load"] = self.monitor.finish()
        self._write()
        self._plot()
        self._print_table()
        failed = [name for name, entry in self.report["sections"].items() if entry["status"] == "failed"]
        return 1 if failed else 0

    def _run_section(self, name: str, estimate: Callable, section: Callable) -> None:
        needed = estimate(self)
        entry: dict = {"estimated_s": needed}
        if needed is None:
            entry.update(status="skipped", reason=NOT_APPLICABLE.get(name, "not applicable here"))
        elif needed > self.left():
            entry.update(status="skipped", reason=f"estimated {needed:.0f} s but {max(0.0, self.left()):.0f} s of "
                                                  f"the {self.args.budget_s:.0f} s budget left")
        else:
            print(f"\n== {name} (estimated {needed:.0f} s, {self.left():.0f} s left)", flush=True)
            self.running = name
            started = time.monotonic()
            try:
                result = section(self)
                entry.update(result)
                entry["status"] = "ok" if result.get("ok", True) else "failed"
            except Exception as error:  # noqa: BLE001 - one section failing must not lose the others
                entry.update(status="failed", error=f"{type(error).__name__}: {error}",
                             traceback=traceback.format_exc()[-4000:])
            entry["seconds"] = round(time.monotonic() - started, 1)
            self.running = None
            print(f"   {entry['status']} in {entry['seconds']} s: {entry.get('summary') or entry.get('error', '')}",
                  flush=True)
        self.report["sections"][name] = entry
        self._write()

    def _write(self) -> None:
        write_json(self.path, self.report)

    def _hard_stop(self) -> None:
        """The budget is far exceeded (a hung section): record it, end this suite's child processes, exit."""
        if self.running:
            self.report["sections"][self.running] = {"status": "failed", "error": "aborted: the budget plus "
                                                     f"{HARD_STOP_GRACE_S} s grace ran out during this section"}
        self.report["aborted"] = True
        self._write()
        for child in multiprocessing.active_children():
            child.kill()
        print(f"gpu-suite: aborted in section {self.running}: over budget; partial results in {self.path}",
              file=sys.stderr, flush=True)
        os._exit(3)

    def _plot(self) -> None:
        from .gpu_report import save_suite_plot
        try:
            path = save_suite_plot(self.report, os.path.join(self.out, "gpu_suite.png"))
            self.report["plot"] = os.path.basename(path) if path else "skipped: neither matplotlib nor pillow"
        except Exception as error:  # noqa: BLE001 - a plot must not lose the numbers
            self.report["plot"] = f"failed: {type(error).__name__}: {error}"
        self._write()

    def _print_table(self) -> None:
        print(f"\n{'section':<18} {'status':<8} {'s':>6}  result", flush=True)
        for name, entry in self.report["sections"].items():
            detail = entry.get("summary") or entry.get("reason") or entry.get("error", "")
            print(f"{name:<18} {entry['status']:<8} {entry.get('seconds', 0):>6}  {str(detail)[:110]}")
        print(f"wrote {self.path} (plot: {self.report.get('plot')})", flush=True)


# ---- sections ------------------------------------------------------------------------------------------------------
def _environment(suite: Suite) -> dict:
    from sp_runtime.cli.doctor import _gpus, _nvidia_smi, _peer_access, _Printer
    quiet = _Printer(True)
    result = {"machine": describe_machine(), "gpus": _gpus(quiet)}
    if suite.gpus > 1:
        result["p2p"] = _peer_access(quiet, suite.devices)
    result["packages"] = _package_versions()
    result["nvidia_smi"] = _nvidia_smi(["--query-gpu=name,driver_version,memory.total,pcie.link.gen.max,"
                                        "pcie.link.width.max,clocks.max.sm", "--format=csv"])
    result["summary"] = (f"{suite.report['hardware']}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
                         f"NCCL {result['gpus'].get('nccl')}, driver {result['gpus'].get('driver')}; missing: "
                         f"{', '.join(n for n, v in result['packages'].items() if v is None) or 'nothing'}")
    return result


def _package_versions() -> dict:
    """Versions of what the sections use (None: not importable); flash-attn / SageAttention are optional."""
    import importlib
    versions = {}
    for name in ("diffusers", "accelerate", "safetensors", "psutil", "triton", "matplotlib", "PIL", "flash_attn",
                 "flash_attn_interface", "sageattention"):
        try:
            versions[name] = str(getattr(importlib.import_module(name), "__version__", "present"))
        except Exception:  # noqa: BLE001 - absent or broken: reported as missing
            versions[name] = None
    return versions


def _correctness(suite: Suite) -> dict:
    """World 1 through the pool vs diffusers' stock forward in this process, tiny Qwen-Image and Flux."""
    from sp_runtime.config import SPConfig
    from sp_runtime.families import family as registered
    from sp_runtime.pool import WorkerPool
    from ..references import reference_forward
    from ..tiny_models import write_tiny_checkpoint
    device = suite.devices[0]
    rows = []
    with WorkerPool(SPConfig([device])) as pool:
        for family in ("qwen_image", "flux"):
            reference = reference_forward(family)
            path = write_tiny_checkpoint(family, os.path.join(suite.scratch, f"{family}.safetensors"), seed=1)
            for dtype in ("float32", "bfloat16"):
                handle = pool.load_model(path, dtype)
                model = registered(family).load_model(path, dtype, torch.device(device))[0]
                worst_call = None
                # three calls with new noise and new conditioning of the same shapes: the workers' device cache
                # (inputs cast and copied to the GPU) must follow the new inputs, never serve a cached copy
                for seed in CORRECTNESS_SEEDS:
                    row = _correctness_call(handle, model, reference, family, dtype, seed)
                    worst_call = row if worst_call is None or row["relative"] > worst_call["relative"] else worst_call
                del model
                rows.append({key: value for key, value in worst_call.items() if key != "relative"})
                pool.unload(handle)
    worst = max(rows, key=lambda r: r["max_abs_difference"] / r["output_scale"] / r["tolerance"])
    return {"how": "pool world 1 on " + device + " vs diffusers' stock forward in this process, same file and "
                   f"dtype policy; odd latent 9x7, batch 2, Qwen-Image text mask; {len(CORRECTNESS_SEEDS)} calls "
                   "with new inputs each (the worst per row)", "rows": rows,
            "ok": all(r["ok"] for r in rows),
            "summary": "; ".join(f"{r['family']} {r['dtype']} {r['max_abs_difference'] / r['output_scale']:.1e}"
                                 for r in rows) + f" (worst vs bar: {worst['family']} {worst['dtype']})"}


CORRECTNESS_SEEDS = (2, 3, 4)


def _correctness_call(handle, model, reference_forward, family: str, dtype: str, seed: int) -> dict:
    """One pool call on seeded inputs against the reference forward of the same inputs."""
    from .sampling import make_workload, model_timestep
    workload = make_workload(family, handle.info.config, handle.info.in_channels, 56, 72, batch=2,
                             text_tokens=9, seed=seed)
    inputs = dict(workload.conditioning)
    if family == "qwen_image":
        inputs["attention_mask"] = torch.ones(2, 9, dtype=torch.long)
        inputs["attention_mask"][1, 5:] = 0
    t = model_timestep(family, 0.5, 2)  # bf16-exact
    ours = handle(workload.noise, t, **inputs)
    reference = reference_forward(model, workload.noise, t, **inputs)
    scale = max(1.0, float(reference.abs().max()))
    difference = float((ours.float() - reference.float()).abs().max())
    limit = 1e-5 if dtype == "float32" else 2e-2
    return {"family": family, "dtype": dtype, "image_tokens": workload.tokens, "seed": seed,
            "max_abs_difference": difference, "output_scale": scale, "tolerance": limit,
            "ok": difference <= limit * scale, "relative": difference / scale}


def _attention_plan(suite: Suite) -> list[tuple[str, list[str], Optional[str], dict]]:
    """(label, rank devices, backend, layout) per layout the machine can run."""
    if suite.gpus >= 2:
        plans = [("u2", suite.devices[:2], None, {"ulysses_degree": 2}),
                 ("r2", suite.devices[:2], None, {"ulysses_degree": 1, "ring_degree": 2})]
        if suite.gpus >= 3:  # ring degree 3: the running log-sum-exp is used after a merge (at 2 it is not)
            plans.append(("r3", suite.devices[:3], None, {"ulysses_degree": 1, "ring_degree": 3}))
        if suite.gpus >= 4:
            plans.append(("u2r2", suite.devices[:4], None, {"ulysses_degree": 2, "ring_degree": 2}))
        return plans
    device = suite.devices[0]
    plans = [("u2", [device] * 2, "gloo", {"ulysses_degree": 2}),
             ("r2", [device] * 2, "gloo", {"ulysses_degree": 1, "ring_degree": 2})]
    if suite.cuda:  # 3-4 ranks on 2 shared CPU cores would only measure the oversubscription
        plans += [("r3", [device] * 3, "gloo", {"ulysses_degree": 1, "ring_degree": 3}),
                  ("u2r2", [device] * 4, "gloo", {"ulysses_degree": 2, "ring_degree": 2})]
    return plans


def _attention_cases(suite: Suite) -> list[dict]:
    from .gpu_checks import AttentionCase
    cases = [AttentionCase(f"odd63_h3_text_masked_b2_{d}", 63, 3, 16, 7, True, 2, d) for d in ("float32", "bfloat16")]
    cases.append(AttentionCase("odd189_h6_b1_float32", 189, 6, 64, 0, False, 1, "float32"))
    if suite.cuda:  # the sizes where CUDA picks flash / memory-efficient kernels
        cases += [AttentionCase("s4099_h24_d128_text77_masked_bf16", 4099, 24, 128, 77, True, 1, "bfloat16"),
                  AttentionCase("s4096_h24_d128_bf16", 4096, 24, 128, 0, False, 1, "bfloat16")]
    return [dataclasses.asdict(case) for case in cases]


def _attention(suite: Suite) -> dict:
    from .gpu_checks import attention_parity, worst_by_case
    from sp_runtime.cli.linkprobe import run_ranks
    cases = _attention_cases(suite)
    dtypes = {case["name"]: case["dtype"] for case in cases}
    layouts = {}
    for label, devices, backend, layout in _attention_plan(suite):
        variants = [{"name": "plain"}]
        if layout["ulysses_degree"] > 1:
            variants += [{"name": "fp8_exchange", "fp8_exchange": True}, {"name": "overlap", "overlap": True}]
        try:
            per_rank = run_ranks(attention_parity, devices, layout, cases, variants, timeout=300, backend=backend)
            layouts[label] = {"ranks": len(devices), "backend": backend or "nccl",
                              "rows": worst_by_case(per_rank, dtypes)}
        except (RuntimeError, TimeoutError) as error:
            layouts[label] = {"error": str(error)[-3000:]}
    ok = all("rows" in entry and all(row["ok"] for row in entry["rows"]) for entry in layouts.values())
    how = ("NCCL, one rank per GPU" if suite.gpus >= 2 else
           "gloo, ranks sharing " + suite.devices[0] + (" (CUDA kernels, host-staged exchanges)" if suite.cuda
                                                        else ""))
    return {"how": how + "; each rank's sp_attention output vs plain float32 SDPA over the whole sequence",
            "layouts": layouts, "ok": ok, "summary": _attention_summary(layouts)}


def _attention_summary(layouts: dict) -> str:
    """Per layout, the worst max |difference| / scale per variant and dtype."""
    parts = []
    for label, entry in layouts.items():
        if "error" in entry:
            parts.append(f"{label} FAILED")
            continue
        worst: dict[str, float] = {}
        for row in entry["rows"]:
            key = f"{row['variant']} {'fp32' if 'float32' in row['case'] else 'bf16'}"
            worst[key] = max(worst.get(key, 0.0), row["max_abs_difference"] / row["output_scale"])
        bad = sum(not row["ok"] for row in entry["rows"])
        parts.append(f"{label}: " + ", ".join(f"{key} {error:.1e}" for key, error in worst.items())
                     + (f" ({bad} above bar)" if bad else ""))
    return "; ".join(parts)


def _fp8(suite: Suite) -> dict:
    from .gpu_checks import fp8_error
    device = torch.device(suite.devices[0])
    # Flux 1024^2 at Ulysses 2: [P, 3 (q,k,v), B, heads per rank, tokens per rank, head size]
    shape = (2, 3, 1, 12, 2304, 128) if suite.cuda else (2, 3, 1, 3, 64, 16)
    result = fp8_error(device, shape)
    result["summary"] = (f"bytes x{result['bytes_ratio']:.3f} of bf16, max error {result['max_error_vs_row_amax']:.3f}"
                         f" of the row's amax (mean {result['mean_error_vs_row_amax']:.4f}), quantize+dequantize "
                         f"{result['quantize_dequantize_ms']:.2f} ms")
    return result


def _bandwidth(suite: Suite) -> dict:
    from .gpu_checks import exchange_sweep
    from sp_runtime.cli.linkprobe import run_ranks
    if suite.gpus >= 2:
        devices, backend, mib = suite.devices, None, (0.25, 1, 4, 16, 64, 256)
        how = f"NCCL all_to_all_single over {len(devices)} GPUs"
    elif suite.cuda:
        devices, backend, mib = [suite.devices[0]] * 2, "gloo", (0.25, 1, 4, 16, 64)
        how = f"gloo on CUDA tensors, 2 ranks sharing {devices[0]} (host-staged: not a GPU link figure)"
    else:
        devices, backend, mib = ["cpu", "cpu"], "gloo", (0.0625, 1)
        how = "gloo on CPU, 2 ranks"
    sizes = [int(m * 2**20) for m in mib]
    per_rank = run_ranks(exchange_sweep, devices, sizes, 5 if suite.cuda else 2, timeout=300, backend=backend)
    rows = []
    for index, row in enumerate(per_rank[0]):
        plain = max(rank_rows[index]["plain_seconds"] for rank_rows in per_rank)
        fp8 = max(rank_rows[index]["fp8_seconds"] for rank_rows in per_rank)
        rows.append({"bf16_bytes_per_rank": row["bytes"], "fp8_bytes_per_rank": row["fp8_bytes"],
                     "plain_ms": round(plain * 1e3, 4), "fp8_ms": round(fp8 * 1e3, 4),
                     "plain_algbw_gb_s": round(row["bytes"] / plain / 1e9, 3),
                     "fp8_effective_gb_s": round(row["bytes"] / fp8 / 1e9, 3),
                     "fp8_speedup": round(plain / fp8, 3)})
    largest = rows[-1]
    return {"how": how + "; fp8 = fp8_exchange's q/k/v codes (encode, exchange, decode); effective GB/s counts "
                         "the bf16 bytes delivered", "rows": rows,
            "summary": f"{largest['bf16_bytes_per_rank'] / 2**20:.0f} MiB: bf16 {largest['plain_algbw_gb_s']:.2f} "
                       f"GB/s; the fp8 exchange takes {1 / largest['fp8_speedup']:.2f}x the bf16 time"}


def _bench_args(argv: list[str]):
    from . import bench
    parser = argparse.ArgumentParser(prog="bench")
    bench.add_arguments(parser)
    return parser.parse_args(argv)


def _multi_gpu_parity(suite: Suite) -> dict:
    from . import bench
    from .bench import default_layouts
    layouts = default_layouts(suite.gpus).split(",") + ["r2", "cfg2"] + (["u2r2", "u2cfg2"] if suite.gpus >= 4
                                                                          else [])
    out = os.path.join(suite.out, "bench_parity_tiny.json")
    code = bench.run(_bench_args(["--preset", "tiny", "--layouts", ",".join(dict.fromkeys(layouts)), "--steps", "2",
                                  "--warmup", "1", "--batch", "2", "--exchange-repeats", "0", "--out", out,
                                  "--cache-dir", os.path.join(suite.scratch, "cache")]))
    return _bench_summary(out, code, "tiny Qwen-Image fp32, 99 tokens (uneven), batch 2, NCCL")


def _step_preset(suite: Suite, name: str):
    """The model of a step-time section and whether its blocks were reduced to fit the budget."""
    from .presets import get_preset
    if not suite.cuda:
        return get_preset({"flux-12b": "tiny-flux", "qwen-image-20b": "tiny"}[name]), None
    preset = get_preset(name)
    full, reduced = STEP_ESTIMATES_S[name]
    if suite.args.full_blocks or full * _per_gpu(suite) <= suite.left():
        return preset, None
    size = dict(preset.size)
    for key in ("num_layers", "num_single_layers"):
        if key in size:
            size[key] = max(1, size[key] // 4)
    note = "blocks reduced to a quarter to fit the budget: " + ", ".join(
        f"{key} {size[key]} of {preset.size[key]}" for key in ("num_layers", "num_single_layers") if key in size)
    return dataclasses.replace(preset, name=preset.name + "-quarter", size=size), note


def _per_gpu(suite: Suite) -> float:
    return 1.0 + 0.6 * max(0, len(_step_layouts(suite)) - 1)


def _step_layouts(suite: Suite) -> list[str]:
    from .bench import default_layouts
    return default_layouts(suite.gpus if suite.cuda else 2).split(",")


def _step_time(suite: Suite, preset_name: str, label: str) -> dict:
    from . import bench
    preset, note = _step_preset(suite, preset_name)
    out = os.path.join(suite.out, f"bench_{label}.json")
    args = _bench_args(["--devices", ",".join(suite.devices), "--steps", "3", "--warmup", "1",
                        "--compare-diffusers", "--exchange-repeats", "3" if suite.gpus >= 2 else "0", "--out", out,
                        "--cache-dir", os.path.join(suite.scratch, "cache")])
    configs = [bench.layout_config(suite.devices, name) for name in _step_layouts(suite)]
    plan = bench._Plan(suite.devices, configs, preset, None, 1)
    code = bench._Bench(args, plan).run()
    result = _bench_summary(out, code, preset.description)
    if note:
        result["reduced"] = note
        result["summary"] += f" [{note}]"
    return result


def _bench_summary(path: str, code: int, what: str) -> dict:
    import json
    if not os.path.exists(path):
        raise RuntimeError(f"bench exited with code {code} before writing {path} (its message is printed above)")
    with open(path, encoding="utf-8") as handle:
        report = json.load(handle)
    layouts = [{key: row.get(key) for key in ("layout", "world_size", "ok", "error", "speedup",
                                               "max_abs_difference_vs_1", "output_scale", "comm_share")}
               | {"median_ms": row.get("step", {}).get("median_ms"),
                  "warmup_ms": row.get("warmup_ms"), "load_s": row.get("load_s"),
                  "peak_gib": _peak_gib(row)} for row in report["layouts"]]
    diffusers = report.get("diffusers_context_parallel", {})
    parts = [f"{row['layout']} {row['median_ms']:.1f} ms" if row["median_ms"] else f"{row['layout']} failed"
             for row in layouts]
    for entry in diffusers.get("layouts", []):
        if "median_ms" in entry:
            parts.append(f"diffusers {entry['layout']} {entry['median_ms']:.1f} ms (its time / ours "
                         f"{entry['ours_vs_diffusers']:.3f})")
        else:
            parts.append(f"diffusers {entry['layout']} failed")
    return {"what": what, "bench_json": os.path.basename(path), "layouts": layouts,
            "diffusers": diffusers, "workload": report.get("workload"), "ok": code == 0,
            "summary": "; ".join(parts)}


def _peak_gib(row: dict) -> Optional[float]:
    peaks = [m.get("peak_bytes") for m in row.get("memory", []) if m.get("peak_bytes")]
    return round(max(peaks) / 2**30, 2) if peaks else None


def _compile(suite: Suite) -> dict:
    from .gpu_checks import compiled_vs_eager
    from sp_runtime.cli.linkprobe import run_ranks
    from sp_runtime.cli.model_shapes import FLUX_12B

    from .presets import diffusers_config, get_preset
    if suite.cuda:
        config = dict(FLUX_12B, num_layers=2, num_single_layers=2)
        size, what = (1024, 1024, 512), "Flux.1-dev blocks at full width (2 double + 2 single), bf16, 1024^2"
        dtype = "bfloat16"
    else:
        config = dict(diffusers_config(get_preset("tiny-flux")), num_layers=1, num_single_layers=1)
        size, what = (80, 64, 7), "tiny Flux (1 double + 1 single block), fp32"
        dtype = "float32"
    result = run_ranks(compiled_vs_eager, suite.devices[:1], "flux", config, dtype, *size, 3, timeout=600)[0]
    limit = 1e-5 if dtype == "float32" else 2e-2
    result.update(what=what, tolerance=limit,
                  ok=result["max_abs_difference"] <= limit * result["output_scale"],
                  summary=f"eager {result['eager_ms']:.1f} ms, compiled {result['compiled_ms']:.1f} ms "
                          f"(x{result['eager_ms'] / result['compiled_ms']:.2f}), compile warm-up "
                          f"{result['compile_warmup_s']:.1f} s, {result['graph_breaks']} graph breaks, max diff "
                          f"{result['max_abs_difference'] / result['output_scale']:.1e} of scale")
    return result


QUANT_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "benchmarks", "bench_quant_vs_comfyui.py")
QUANT_FORMATS = "bf16,float8_e4m3fn,int8_convrot"  # the templates' commonest: fp8 (scaled) and int8 convrot


def _comfyui_for_quant() -> Optional[str]:
    """The ComfyUI checkout the quantized-files comparison runs (COMFYUI_PATH), None when it cannot run here."""
    path = os.environ.get("COMFYUI_PATH")
    if not path or not os.path.isfile(os.path.join(path, "comfy", "ops.py")) or not os.path.isfile(QUANT_BENCH):
        return None
    return path


def _quant_vs_comfyui(suite: Suite) -> dict:
    """Stock ComfyUI vs the pool at world 1 on the same bf16 / fp8 / int8 convrot files (a separate process:
    sp_runtime never imports ComfyUI): full-width Wan 2.1 14B blocks on the first GPU, tiny on CPU."""
    import json
    import subprocess
    out = os.path.join(suite.out, "quant_vs_comfyui.json")
    command = [sys.executable, QUANT_BENCH, "--comfyui", _comfyui_for_quant(), "--formats", QUANT_FORMATS,
               "--out", out, "--rounds", "5"]
    command += ["--device", suite.devices[0], "--size", "full", "--layers", "4"] if suite.cuda else []
    done = subprocess.run(command, timeout=max(60.0, suite.left()), capture_output=True, text=True)
    if done.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"{os.path.basename(QUANT_BENCH)} exited with code {done.returncode}: "
                           f"{(done.stderr or done.stdout)[-1500:]}")
    with open(out, encoding="utf-8") as handle:
        report = json.load(handle)
    rows = report["formats"]
    quantized = [name for name in rows if name != "bf16"]
    return {"what": report["what"], "json": os.path.basename(out), "formats": rows,
            "target": "pool within 2% of stock ComfyUI's step time on the fp8 / int8 files (issue 34)",
            "target_met": all(rows[name]["pool_vs_comfyui_time"] <= 1.02 for name in quantized),
            "summary": "; ".join(f"{name} pool/ComfyUI x{row['pool_vs_comfyui_time']:.3f} ({row['pool_ms']:.1f} "
                                 f"vs {row['comfyui_ms']:.1f} ms)" for name, row in rows.items())}


# name -> (estimate(suite) -> seconds or None when not applicable here, section(suite) -> dict)
STEP_ESTIMATES_S = {"flux-12b": (60, 30), "qwen-image-20b": (75, 35)}


def _step_estimate(name: str) -> Callable:
    def estimate(suite: Suite) -> float:
        if not suite.cuda:
            return 60
        full, reduced = STEP_ESTIMATES_S[name]
        per_gpu = _per_gpu(suite)
        return full * per_gpu if suite.args.full_blocks or full * per_gpu <= suite.left() else reduced * per_gpu
    return estimate


SECTIONS = {
    "environment": (lambda s: 5, _environment),
    "correctness": (lambda s: 30 if s.cuda else 45, _correctness),
    "attention": (lambda s: 45 if s.cuda else 60, _attention),
    "fp8": (lambda s: 5, _fp8),
    "bandwidth": (lambda s: 20 if s.cuda else 20, _bandwidth),
    "multi_gpu_parity": (lambda s: 40 + 10 * s.gpus if s.gpus >= 2 else None, _multi_gpu_parity),
    "step_flux": (_step_estimate("flux-12b"), lambda s: _step_time(s, "flux-12b", "flux")),
    "step_qwen_image": (_step_estimate("qwen-image-20b"), lambda s: _step_time(s, "qwen-image-20b", "qwen_image")),
    "compile": (lambda s: 90 if s.cuda else 150, _compile),
    "quant_vs_comfyui": (lambda s: (240 if s.cuda else 180) if _comfyui_for_quant() else None, _quant_vs_comfyui),
}
SECTION_NAMES = tuple(SECTIONS)
NOT_APPLICABLE = {"multi_gpu_parity": "needs 2 or more GPUs (NCCL between distinct GPUs)",
                  "quant_vs_comfyui": "needs COMFYUI_PATH: a ComfyUI checkout whose requirements (comfy-kitchen) "
                                      "this Python has, and the repository's benchmarks/ folder"}
