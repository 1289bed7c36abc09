"""ComfyUI's RAM-pressure node cache and the SP workers. ComfyUI's default cache in 0.33 - 0.38 (`--cache-ram`,
opt-in in 0.2x) keeps a headroom of the machine's free RAM, evicting cached node outputs after each node until that
much is free. The workers' host memory counts against that headroom, and no eviction frees it (the pool keeps its
models whatever ComfyUI caches): after a load, a warning names the flag that stops those evictions in vain.
"""
from __future__ import annotations

import logging
from typing import Iterable, Optional

log = logging.getLogger("ulysses_sp")
GIB = 1024 ** 3
_warned: set[str] = set()


def available_ram() -> int:
    """Free RAM as ComfyUI's cache measures it (newest: clamped to the cgroup's limit)."""
    try:
        from comfy.system_memory import virtual_memory_available
        return int(virtual_memory_available())
    except ImportError:
        import psutil
        return int(psutil.virtual_memory().available)


def cache_headroom() -> int:
    """The free RAM (bytes) ComfyUI's RAM-pressure cache keeps during a prompt; 0 with another cache type or a
    ComfyUI without it (0.3.64)."""
    try:
        import comfy.memory_management as memory
    except ImportError:
        return 0
    if getattr(memory, "extra_ram_release_callback", None) is None:
        return 0
    return int(getattr(memory, "RAM_CACHE_HEADROOM", 0))


def host_bytes(pids: Iterable[int]) -> int:
    """Resident host memory of these processes (the workers); what cannot be read counts 0."""
    import psutil
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except (psutil.Error, OSError):
            pass
    return total


def pressure_warning(worker_pids: Iterable[int]) -> Optional[str]:
    """The warning when free RAM is below ComfyUI's cache headroom, else None."""
    headroom = cache_headroom()
    if not headroom:
        return None
    available = available_ram()
    if available >= headroom:
        return None
    suggestion = f"--cache-ram {max(available // 2 // GIB, 1)}" if available >= 2 * GIB else "--cache-lru 10"
    return (f"ulysses-sp: {available / GIB:.1f} GiB of RAM are free, less than the {headroom / GIB:.1f} GiB ComfyUI's "
            f"RAM-pressure cache keeps free, so after every node ComfyUI evicts cached node outputs (loaded text "
            f"encoders and VAEs, conditionings: they run again on the next prompt). The SP workers hold "
            f"{host_bytes(worker_pids) / GIB:.1f} GiB of host RAM, which no eviction frees. Start ComfyUI with "
            f"{suggestion} (a smaller headroom), or with --cache-lru N / --cache-classic (no RAM-pressure eviction).")


def warn_if_cache_pressure(worker_pids: Iterable[int]) -> Optional[str]:
    """Log pressure_warning once per process (it is the same advice for every load); returns it."""
    message = pressure_warning(worker_pids)
    if message is not None and not _warned:
        _warned.add(message)
        log.warning(message)
    return message
