"""Parts of pool.status(): memory figures (RSS and peak RSS of CPU workers measured from the host, CUDA figures
reported by workers, under the same names: "peak" is what the panel and the bench show for every device) and the
machines the ranks run on (what the panel groups its layout grid by)."""
from __future__ import annotations

import socket
import sys
from typing import Optional


def rank_memory(device: str, pid: Optional[int], reported: dict) -> dict:
    if device.startswith("cuda"):
        return dict(reported)
    if pid is None:
        return {}
    try:
        import psutil
        process = psutil.Process(pid)
        memory = {"rss": process.memory_info().rss, **memory_limit(process)}
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


def memory_limit(process) -> dict:
    """What a CPU worker may use: its address-space limit when one is set (RLIMIT_AS), else the machine's memory."""
    import psutil
    if hasattr(psutil, "RLIMIT_AS"):
        soft, _ = process.rlimit(psutil.RLIMIT_AS)
        if soft != psutil.RLIM_INFINITY:
            return {"limit": soft, "limit_kind": "address-space limit"}
    return {"limit": psutil.virtual_memory().total, "limit_kind": "machine memory"}


def machines(devices: list[str], join) -> list[dict]:
    """Each machine the ranks run on, in rank order: {"name": "here" (this computer) or the joined machine's
    `--name`, "host": this computer's host name or the joined machine's address (None until it joins), "joined":
    whether it is connected now, "ranks": its ranks}. join: the pool's JoinPoint (None: one machine)."""
    from ..devices import machine_of
    found: dict[str, dict] = {}
    for rank, device in enumerate(devices):
        name = machine_of(device) or "here"
        if name not in found:
            if name == "here":
                found[name] = {"name": name, "host": socket.gethostname(), "joined": True, "ranks": []}
            else:
                machine = join.machines.get(name) if join is not None else None
                connected = machine is not None and machine.connected
                found[name] = {"name": name, "host": machine.peer if connected else None, "joined": connected,
                               "ranks": []}
        found[name]["ranks"].append(rank)
    return list(found.values())
