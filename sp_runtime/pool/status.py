"""Memory figures for pool.status(): RSS and peak RSS of CPU workers measured from the host, CUDA figures reported
by workers (under the same names: "peak" is what the panel and the bench show for every device)."""
from __future__ import annotations

import sys
from typing import Optional


def rank_memory(device: str, pid: Optional[int], reported: dict) -> dict:
    if device.startswith("cuda"):
        return dict(reported)
    if pid is None:
        return {}
    try:
        import psutil
        memory = {"rss": psutil.Process(pid).memory_info().rss}
    except Exception:  # noqa: BLE001 - psutil missing or the process just ended
        return {}
    peak = peak_rss(pid)
    if peak is not None:
        memory["peak"] = peak
    return memory


def peak_rss(pid: int) -> Optional[int]:
    """The process's peak resident set in bytes (Linux VmHWM: since it started, or since a write of "5" to
    /proc/<pid>/clear_refs); None elsewhere or when it cannot be read. Hand-read: psutil does not report it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB
    except (OSError, ValueError):
        return None
    return None
