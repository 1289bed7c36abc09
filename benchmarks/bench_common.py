"""What the benchmark scripts share: timing repeated calls after a warm-up, the machine's name, the result file."""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from typing import Callable, Optional


def timings(fn: Callable[[], object], repeats: int, barrier: Optional[Callable[[], object]] = None,
            warmups: int = 1) -> list[float]:
    """Seconds of each of `repeats` calls of fn after `warmups` untimed ones; barrier(), when given, runs before
    each timed call (so that distributed ranks start each repeat together)."""
    for _ in range(warmups):
        fn()
    times = []
    for _ in range(repeats):
        if barrier:
            barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def median_time(fn: Callable[[], object], repeats: int, barrier: Optional[Callable[[], object]] = None) -> float:
    """Median seconds of fn() over `repeats` calls after one warm-up (see timings)."""
    return statistics.median(timings(fn, repeats, barrier))


def machine() -> str:
    """Processor and CPU count, as the result files name the machine."""
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"


def write_result(path: str, result: dict) -> None:
    """Write a benchmark's result as indented JSON (creating its folder) and say where."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=2)
    print(f"wrote {path}")
