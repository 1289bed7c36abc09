"""What the CLI commands and benchmarks/ report about the machine and their runs: devices, versions, load average,
timings of repeated calls and their summaries, and the result JSON (one helper for both)."""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from typing import Callable, Optional, Sequence

import torch

from .. import devices

DEFAULT_CPU_WORKERS = 2


def parse_devices(text: Optional[str], cpu_workers: int = DEFAULT_CPU_WORKERS) -> list[str]:
    """--devices in the grammar of sp_runtime.devices; none given = every GPU, else `cpu_workers` CPU workers."""
    return devices.parse_devices(text or "auto", auto_cpu_workers=cpu_workers)


def load_average() -> Optional[list[float]]:
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except (OSError, AttributeError):
        return None


class LoadMonitor:
    """Whether other processes competed for the CPUs during a run: CPU time the whole machine spent busy, less what
    this process and its reaped children (the pool's workers, the link probes) used, as a share of all cores.

    The load average lags by a minute and counts this run's own processes, so it is reported but not judged on.
    """

    BUSY_SHARE = 0.10  # others may use up to 10% of the cores before timings are called into question

    def __init__(self):
        self.started = time.monotonic()
        self.system = _busy_cpu_seconds()
        self.own = _own_cpu_seconds()
        self.load_before = load_average()

    def finish(self) -> dict:
        wall = max(1e-9, time.monotonic() - self.started)
        cores = os.cpu_count() or 1
        others = None
        if self.system is not None:
            others = max(0.0, (_busy_cpu_seconds() - self.system) - (_own_cpu_seconds() - self.own))
        share = None if others is None else others / (wall * cores)
        result = {"other_processes_cpu_share": None if share is None else round(share, 3),
                  "load_average_before": self.load_before, "load_average_after": load_average(),
                  "seconds": round(wall, 1), "quiet": share is not None and share <= self.BUSY_SHARE}
        if share is None:
            result["note"] = "could not measure other processes' CPU use (psutil missing): timings unverified"
        elif result["quiet"]:
            result["note"] = f"machine quiet: other processes used {share:.0%} of the {cores} cores during the run"
        else:
            result["note"] = (f"machine busy: other processes used {share:.0%} of the {cores} cores during the run, "
                              f"so timings are pessimistic; re-measure on a quiet machine")
        return result


def _busy_cpu_seconds() -> Optional[float]:
    try:
        import psutil
    except ImportError:
        return None
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0) - getattr(times, "guest", 0.0) \
        - getattr(times, "guest_nice", 0.0)


def _own_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def command_line(command: str, args) -> str:
    """The command that reproduces this run (command: program and subcommand), every option spelled out."""
    parts = [command]
    for name, value in vars(args).items():
        if name == "command" or value is None or value is False:
            continue
        option = "--" + name.replace("_", "-")
        parts.append(option if value is True else f"{option} {value}")
    return " ".join(parts)


def gpu_descriptions() -> list[dict]:
    if not torch.cuda.is_available():
        return []
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append({"device": f"cuda:{index}", "name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                     "compute_capability": f"{props.major}.{props.minor}",
                     "multiprocessors": props.multi_processor_count})
    return gpus


def describe_machine() -> dict:
    info = {"platform": platform.platform(), "machine": platform.machine(), "python": sys.version.split()[0],
            "torch": torch.__version__, "cpu_cores": os.cpu_count(), "gpus": gpu_descriptions()}
    try:
        import diffusers
        info["diffusers"] = diffusers.__version__
    except ImportError:
        info["diffusers"] = None
    try:
        import psutil
        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
        info["physical_cores"] = psutil.cpu_count(logical=False)
    except ImportError:
        pass
    if torch.version.cuda:
        info["cuda_runtime"] = torch.version.cuda
    return info


def hardware_label(devices: Sequence[str]) -> str:
    """'2x NVIDIA H100 80GB HBM3' or 'x86_64, 2 CPU cores'."""
    if devices and devices[0].startswith("cuda"):
        names = {torch.cuda.get_device_properties(int(d.split(":")[1])).name for d in devices}
        return f"{len(devices)}x {' / '.join(sorted(names))}"
    return f"{platform.machine()}, {os.cpu_count()} CPU cores"


def timings(fn: Callable[[], object], repeats: int, barrier: Optional[Callable[[], object]] = None,
            warmups: int = 1, sync: Optional[Callable[[], object]] = None) -> list[float]:
    """Seconds of each of `repeats` calls of fn after `warmups` untimed ones. barrier(), when given, runs before
    each timed call (so that distributed ranks start each repeat together); sync(), when given, waits for the
    device's queued work before the clock starts and before it stops (see device_sync)."""
    sync = sync or (lambda: None)
    for _ in range(warmups):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        if barrier:
            barrier()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def median_time(fn: Callable[[], object], repeats: int, barrier: Optional[Callable[[], object]] = None,
                sync: Optional[Callable[[], object]] = None) -> float:
    """Median seconds of fn() over `repeats` calls after one warm-up (see timings)."""
    return statistics.median(timings(fn, repeats, barrier, sync=sync))


def device_sync(device) -> Optional[Callable[[], None]]:
    """The sync() of timings for a torch device: torch.cuda.synchronize on a GPU, None on the CPU."""
    device = torch.device(device)
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None


def time_summary(seconds: Sequence[float]) -> dict:
    """Median and spread of step times, in milliseconds."""
    values = sorted(seconds)
    ms = [value * 1e3 for value in values]
    quartiles = statistics.quantiles(ms, n=4) if len(ms) >= 2 else [ms[0]] * 3
    return {"median_ms": round(statistics.median(ms), 3), "min_ms": round(ms[0], 3), "max_ms": round(ms[-1], 3),
            "mean_ms": round(statistics.fmean(ms), 3),
            "stdev_ms": round(statistics.stdev(ms), 3) if len(ms) >= 2 else 0.0,
            "iqr_ms": round(quartiles[2] - quartiles[0], 3), "samples": len(ms)}


def write_json(path: str, data: dict, say: bool = False) -> str:
    """Write indented JSON (creating its folder); say=True prints where (the benchmarks' result files)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, default=_jsonable)
        handle.write("\n")
    if say:
        print(f"wrote {path}")
    return path


def _jsonable(value):
    if isinstance(value, (tuple, set)):
        return list(value)
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return str(value)


def tolerance_for(dtype: str) -> float:
    """Allowed max |SP - one device| / max(1, max |one device|): fp32 exact to rounding, bf16/fp16 to theirs."""
    return {"float32": 1e-5}.get(dtype, 2e-2)
