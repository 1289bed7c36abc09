"""`python -m sp_runtime doctor`: the devices, whether workers start on them, the all-to-all bandwidth between them
(and missing GPU peer-to-peer), and the degrees to use for a model and resolution, with the reasons.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Optional

import torch

from ..config import SPConfig
from .machine import DEFAULT_CPU_WORKERS, LoadMonitor, describe_machine, parse_devices, write_json
from .model_shapes import DOCTOR_MODELS

NCCL_P2P_REMEDIES = [
    "NCCL then copies through host memory: expect lower all-to-all bandwidth (see the table) and prefer fewer ranks",
    "if NCCL hangs or fails at start: export NCCL_P2P_DISABLE=1 (forces the host-memory path)",
    "on machines without InfiniBand: export NCCL_IB_DISABLE=1",
    "for PCIe peer-to-peer on workstations: disable IOMMU / ACS in the BIOS or kernel (iommu=pt), and use the same "
    "driver for all GPUs",
    "to see what NCCL chooses: NCCL_DEBUG=INFO; the topology: nvidia-smi topo -m",
]
GPU_SIZES_MIB = (0.0625, 0.25, 1, 4, 16, 64, 256)
CPU_SIZES_MIB = (0.0625, 0.25, 1, 4, 16)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=sorted(DOCTOR_MODELS), default="qwen-image",
                        help="model to recommend degrees for (default: qwen-image)")
    parser.add_argument("--width", type=int, default=None, help="image width (default: the model's usual)")
    parser.add_argument("--height", type=int, default=None, help="image height (default: the model's usual)")
    parser.add_argument("--frames", type=int, default=None, help="video frames (wan; default 81)")
    parser.add_argument("--text-tokens", type=int, default=None)
    parser.add_argument("--devices", default=None, help="devices to check (default: every GPU, else 2 CPU workers)")
    parser.add_argument("--cpu-workers", type=int, default=DEFAULT_CPU_WORKERS)
    parser.add_argument("--sizes", default=None, help="all-to-all message sizes in MiB per rank, comma-separated "
                                                      "(default: 0.0625 .. 256 on GPUs, .. 16 on CPUs)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per message size (default: 5)")
    parser.add_argument("--skip-workers", action="store_true", help="do not start a worker pool")
    parser.add_argument("--skip-bandwidth", action="store_true", help="do not measure the links")
    parser.add_argument("--plan-devices", type=int, default=None,
                        help="predict layouts on this many devices (default: the devices checked)")
    parser.add_argument("--link-gbs", type=float, default=None,
                        help="stated link bandwidth per device and direction, GB/s (default: the measured sweep)")
    parser.add_argument("--tflops", default=None, help="stated achieved TFLOP/s: MATMUL[,ATTENTION] (default: "
                                                       "measured on the first device)")
    parser.add_argument("--memory-gb", type=float, default=None, help="memory per device (default: the GPUs')")
    parser.add_argument("--machines", default=None,
                        help="other machines to measure the link to, comma-separated names (they join with `python -m "
                             "sp_runtime join`); with --listen and --token-file")
    parser.add_argument("--listen", default="127.0.0.1:29600",
                        help="address the machines join (an interface of this machine, HOST:PORT)")
    parser.add_argument("--token-file", default=None, help="the shared secret the machines join with")
    parser.add_argument("--json", default=None, help="also write the report as JSON to this path ('-': stdout, "
                                                     "and nothing else there)")


def run(args) -> int:
    quiet = args.json == "-"
    out = _Printer(quiet)
    try:
        devices = parse_devices(args.devices, args.cpu_workers)
        SPConfig(devices)
        sizes = _sizes(args.sizes, devices)
        if args.repeats < 1:
            raise ValueError("--repeats must be at least 1")
        stated = _stated(args)
    except ValueError as error:
        print(f"doctor: {error}", file=sys.stderr)
        return 2
    monitor = LoadMonitor()
    report = {"machine": describe_machine(), "devices": devices}
    out.section("devices")
    report["gpus"] = _gpus(out)
    report["cpu"] = _cpu(out, devices)
    if len([d for d in devices if d.startswith("cuda")]) > 1:
        out.section("peer-to-peer")
        report["p2p"] = _peer_access(out, devices)
    if not args.skip_workers:
        out.section("workers")
        report["workers"] = _worker_check(out, devices)
    if len(devices) > 1 and not args.skip_bandwidth:
        out.section(f"all-to-all bandwidth over {len(devices)} ranks")
        report["all_to_all"] = _bandwidth(out, devices, sizes, args.repeats)
    out.section(f"predicted step time per layout for {args.model}")
    planning: dict = {}
    report["recommendation"] = _recommendation(out, args, devices, report.get("all_to_all"), stated, planning)
    if args.machines:
        out.section("machines")
        report["machines"] = _machines(out, args, devices, planning)
    report["machine_load"] = monitor.finish()
    out.line(report["machine_load"]["note"])
    if args.json == "-":
        json.dump(report, sys.stdout, indent=2, default=str)
        print()
    elif args.json:
        out.line(f"wrote {write_json(args.json, report)}")
    failed = not report.get("workers", {}).get("ok", True) or "error" in report.get("all_to_all", {})
    return 1 if failed else 0


class _Printer:
    def __init__(self, quiet: bool):
        self.quiet = quiet

    def section(self, title: str) -> None:
        self.line(f"\n== {title}")

    def line(self, text: str) -> None:
        if not self.quiet:
            print(text, flush=True)


def _sizes(text: Optional[str], devices: list[str]) -> list[int]:
    if text:
        try:
            values = [float(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise ValueError(f"--sizes {text!r} must be numbers of MiB, e.g. 1,16,64") from None
        if not values or min(values) <= 0:
            raise ValueError(f"--sizes {text!r} must be positive numbers of MiB")
    else:
        values = GPU_SIZES_MIB if devices[0].startswith("cuda") else CPU_SIZES_MIB
    return [int(value * 2**20) for value in values]


def _stated(args) -> dict:
    """--tflops / --link-gbs / --plan-devices / --memory-gb, checked."""
    stated = {}
    if args.tflops:
        try:
            values = [float(part) * 1e12 for part in args.tflops.split(",")]
        except ValueError:
            raise ValueError(f"--tflops {args.tflops!r} must be MATMUL[,ATTENTION] TFLOP/s, e.g. 600,350") from None
        if not 1 <= len(values) <= 2 or min(values) <= 0:
            raise ValueError(f"--tflops {args.tflops!r} must be one or two positive numbers")
        stated["flops"] = (values[0], values[-1])
    for name in ("link_gbs", "memory_gb", "plan_devices"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    return stated


# ---- devices -------------------------------------------------------------------------------------------------------
def _gpus(out: _Printer) -> dict:
    if not torch.cuda.is_available():
        out.line(f"CUDA: none (torch {torch.__version__}"
                 f"{', a CPU-only build' if torch.version.cuda is None else ', no driver or no GPU visible'})")
        return {"count": 0}
    info = {"count": torch.cuda.device_count(), "cuda_runtime": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None,
            "driver": _nvidia_smi(["--query-gpu=driver_version", "--format=csv,noheader"]), "devices": []}
    out.line(f"CUDA runtime {info['cuda_runtime']}, NCCL {info['nccl']}, driver "
             f"{(info['driver'] or 'unknown').splitlines()[0] if info['driver'] else 'unknown'}")
    for index in range(info["count"]):
        props = torch.cuda.get_device_properties(index)
        entry = {"device": f"cuda:{index}", "name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                 "compute_capability": f"{props.major}.{props.minor}", "bf16": props.major >= 8}
        info["devices"].append(entry)
        out.line(f"cuda:{index}  {props.name}, {entry['memory_gib']} GiB, compute capability "
                 f"{entry['compute_capability']}" + ("" if entry["bf16"] else " (no native bf16: use fp16/fp32)"))
    topology = _nvidia_smi(["topo", "-m"])
    if topology:
        info["topology"] = topology
    return info


def _cpu(out: _Printer, devices: list[str]) -> dict:
    info = {"logical_cores": os.cpu_count()}
    try:
        import psutil
        info.update(physical_cores=psutil.cpu_count(logical=False),
                    memory_gib=round(psutil.virtual_memory().total / 2**30, 1),
                    available_gib=round(psutil.virtual_memory().available / 2**30, 1))
    except ImportError:
        pass
    out.line(f"CPU: {info['logical_cores']} logical cores, {info.get('memory_gib', '?')} GiB memory "
             f"({info.get('available_gib', '?')} GiB free)")
    if not devices[0].startswith("cuda"):
        out.line(f"using {len(devices)} CPU workers (gloo); they share these cores")
    return info


def _nvidia_smi(arguments: list[str]) -> Optional[str]:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        done = subprocess.run(["nvidia-smi", *arguments], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _peer_access(out: _Printer, devices: list[str]) -> dict:
    indices = [int(d.split(":")[1]) for d in devices]
    matrix = {f"{a}->{b}": bool(torch.cuda.can_device_access_peer(a, b)) for a in indices for b in indices if a != b}
    missing = [pair for pair, ok in matrix.items() if not ok]
    if missing:
        out.line(f"no peer-to-peer access between {', '.join(missing)} (PCIe without P2P, or across CPU sockets)")
        for remedy in NCCL_P2P_REMEDIES:
            out.line(f"  - {remedy}")
    else:
        out.line(f"every GPU pair has peer-to-peer access ({len(matrix)} directions)")
    return {"matrix": matrix, "missing": missing, "remedies": NCCL_P2P_REMEDIES if missing else []}


# ---- workers and links ---------------------------------------------------------------------------------------------
def _worker_check(out: _Printer, devices: list[str]) -> dict:
    """One pool over every device; if it cannot start, one world-1 pool per device to find the culprit."""
    from ..pool import PoolStartError, WorkerPool
    started = time.perf_counter()
    try:
        with WorkerPool(SPConfig(devices), start_timeout_s=120) as pool:
            seconds = time.perf_counter() - started
            pids = pool.worker_pids
        out.line(f"a pool of {len(devices)} workers ({SPConfig(devices).backend}) started in {seconds:.1f} s "
                 f"(pids {pids}) and stopped cleanly")
        return {"ok": True, "start_s": round(seconds, 3), "per_device": None}
    except PoolStartError as error:
        first = str(error).splitlines()[0]
        out.line(f"a pool over all devices could not start: {first}")
    per_device = []
    for device in dict.fromkeys(devices):
        try:
            with WorkerPool(SPConfig([device]), start_timeout_s=120):
                per_device.append({"device": device, "ok": True})
                out.line(f"  {device}: a single worker starts")
        except PoolStartError as error:
            per_device.append({"device": device, "ok": False, "error": str(error).splitlines()[0]})
            out.line(f"  {device}: FAILS: {str(error).splitlines()[0]}")
    return {"ok": False, "per_device": per_device}


def _bandwidth(out: _Printer, devices: list[str], sizes: list[int], repeats: int) -> dict:
    from .linkprobe import all_to_all_sweep, run_ranks
    try:
        per_rank = run_ranks(all_to_all_sweep, devices, sizes, repeats, timeout=600)
    except (RuntimeError, TimeoutError) as error:
        out.line(f"the all-to-all failed: {str(error).strip().splitlines()[-1]}")
        return {"error": str(error)}
    world = len(devices)
    rows = []
    out.line(f"{'MiB per rank':>12} {'time ms':>9} {'algbw GB/s':>11} {'busbw GB/s':>11}")
    for index, size in enumerate(sizes):
        seconds = max(rank_rows[index]["seconds"] for rank_rows in per_rank)
        message = per_rank[0][index]["bytes"]
        algbw = message / seconds / 1e9
        rows.append({"bytes": message, "seconds": seconds, "algbw_gb_s": round(algbw, 3),
                     "busbw_gb_s": round(algbw * (world - 1) / world, 3)})
        out.line(f"{message / 2**20:>12.4g} {seconds * 1e3:>9.3f} {algbw:>11.2f} {rows[-1]['busbw_gb_s']:>11.2f}")
    out.line("algbw = bytes each rank sends / time; busbw = algbw x (n-1)/n, the share that crosses the links "
             "(nccl-tests' convention)")
    return {"ranks": world, "rows": rows}


def _machines(out: _Printer, args, devices: list[str], planning: dict) -> dict:
    """The link to each joined machine and the layout across machines (Ulysses inside each one, Ring / CFG across)."""
    from .links import compare_layouts, measure_links
    if not args.token_file:
        out.line("--machines needs --token-file (the secret the machines join with)")
        return {"error": "no token file"}
    names = [name.strip().lower() for name in args.machines.split(",") if name.strip()]
    links = measure_links(out, args.listen, args.token_file, names)
    report = {"links_bytes_per_s": links}
    if links:
        slowest = min(links.values())
        report["layouts"] = compare_layouts(out, planning["shape"], planning["tokens"], planning["text"],
                                            planning["device"], planning["link"], slowest, len(devices),
                                            1 + len(links))
    return report


def _recommendation(out: _Printer, args, devices: list[str], sweep: Optional[dict], stated: dict,
                    planning: Optional[dict] = None) -> dict:
    """The speed model's table for the model and resolution: every layout (Ulysses, Ring, hybrid, CFG, TP,
    shard_weights) on up to --plan-devices, from the stated or measured throughput and link, and its recommendation:
    the fastest that fits in memory (fewer devices when within 5%), with the reasons."""
    from .model_shapes import FULL_SIZE, latent_shape, token_count
    from .speed_model import Device, Link, Throughput, format_table, known_shape, measure_throughput, plan
    preset = FULL_SIZE[DOCTOR_MODELS[args.model]]
    width, height = args.width or preset.width, args.height or preset.height
    frames = args.frames or preset.frames
    tokens = token_count(preset.family, latent_shape(preset.family, 16, width, height, frames))
    text = args.text_tokens or preset.text_tokens
    shape = known_shape(args.model)
    if "flops" in stated:
        matmul, attention = stated["flops"]
        throughput = Throughput(devices[0], "bfloat16", attention, matmul)
    else:
        throughput = measure_throughput(devices[0], shape.heads, shape.head_dim)
    memory = args.memory_gb * 1e9 if args.memory_gb else None
    if memory is None and devices[0].startswith("cuda"):
        memory = min(torch.cuda.get_device_properties(int(d.split(":")[1])).total_memory for d in devices)
    shared = not devices[0].startswith("cuda") and "flops" not in stated
    device = Device(devices[0], throughput.matmul_flops_per_s, throughput.attention_flops_per_s, memory,
                    shared_cores=shared)
    rows = (sweep or {}).get("rows")
    if args.link_gbs:
        link, link_note = Link(args.link_gbs * 1e9), f"stated {args.link_gbs:g} GB/s per direction"
    elif rows:
        link, link_note = Link(float("inf"), sweep=rows), "the measured all-to-all sweep"
    else:
        link, link_note = Link(float("inf"), latency_s=0.0), "link not measured (--link-gbs): exchanges not counted"
    count = args.plan_devices or len(devices)
    if planning is not None:
        planning.update(shape=shape, tokens=tokens, text=text, device=device, link=link)
    result = plan(shape, tokens, text, count, device, link)
    size = f"{width}x{height}" + (f", {frames} frames" if preset.is_video else "")
    out.line(f"{args.model} at {size}: {tokens} image + {text} text tokens{', CFG (batch 2)' if shape.cfg else ''}, "
             f"{shape.heads} heads, {shape.parameters / 1e9:.1f}B parameters; "
             f"{throughput.matmul_flops_per_s / 1e12:.3g} / {throughput.attention_flops_per_s / 1e12:.3g} TFLOP/s "
             f"(matmul / attention, {'stated' if 'flops' in stated else 'measured on ' + devices[0]}, "
             f"{throughput.dtype}); link: {link_note}"
             + ("; CPU workers share their cores: compute does not shrink" if shared else ""))
    for line in format_table(result):
        out.line(line)
    best = result["recommended"]
    reasons = _reasons(result, shape, memory, shared)
    out.line(f"recommended: {best.layout if best else 'none fits'}")
    for reason in reasons:
        out.line(f"  - {reason}")
    return {"model": args.model, "width": width, "height": height, "frames": frames if preset.is_video else None,
            "image_tokens": tokens, "text_tokens": text, "heads": shape.heads, "head_dim": shape.head_dim,
            "parameters": shape.parameters, "throughput": throughput.__dict__, "devices": count, "link": link_note,
            "rows": [row.__dict__ for row in result["rows"]], "recommended_layout": best.layout if best else None,
            "reasons": reasons, "note": "predicted by the speed model (sp_runtime/cli/speed_model.py); measure with "
                                        "`python -m sp_lab bench`"}


def _reasons(result: dict, shape, memory: Optional[float], shared: bool) -> list[str]:
    best, rows = result["recommended"], result["rows"]
    one = next(row for row in rows if row.devices == 1)
    if best is None:
        reasons = [f"no layout fits in {memory / 1e9:.1f} GB per device: load fp8 weights or use larger GPUs"]
    elif best.devices > 1:
        reasons = [f"predicted {best.speedup:.2f}x faster than one device ({best.step_s * 1e3:.1f} vs "
                   f"{one.step_s * 1e3:.1f} ms per step; exchanges {best.exchange_s * 1e3:.1f} ms of it)"]
    else:
        others = [row for row in rows if row.devices > 1]
        reasons = ["one device: nothing to split over"] if not others else [
            f"no layout on more devices is predicted to be at least 5% faster than one device (best: "
            f"{others[0].layout} at {others[0].speedup:.2f}x)"]
    if one.fits is False:
        reasons.append(f"the {shape.parameters * 2 / 1e9:.1f} GB of bf16 weights do not fit on one device "
                       f"({memory / 1e9:.1f} GB): layouts that hold less per device (shard_weights, TP) are needed")
    if shared:
        reasons.append("CPU workers share the same cores: sequence parallelism adds no compute on a CPU-only "
                       "machine (use it for correctness checks); on GPUs each rank brings its own")
    return reasons
