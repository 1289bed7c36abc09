"""The registry of worker pools in the ComfyUI process: one pool per device set, reused across prompts and loaders,
and the pools' events forwarded to the panel. Models, LoRAs, step times and state live in the pools
(sp_runtime.pool); nodes describe the model they want with a ModelSpec. No ComfyUI import here.
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
from typing import Any, Callable, Optional

from sp_runtime.config import SPConfig

from .model_spec import ModelSpec

log = logging.getLogger("ulysses_sp")
Listener = Callable[[str, dict], None]
STATUS_EVENTS = {"loaded", "unloaded", "worker_died", "worker_hung", "restarted"}  # change the panel's picture


def _default_pool_factory(config: SPConfig):
    from sp_runtime import WorkerPool
    return WorkerPool(config)


class PoolOwner:
    """Thread-safe registry of pools keyed by device set; the ComfyUI execution thread and the server both use it."""

    def __init__(self, pool_factory: Callable[[SPConfig], Any] = _default_pool_factory):
        self._factory = pool_factory
        self._pools: dict[tuple[str, ...], Any] = {}
        self._lock = threading.RLock()
        self._listeners: list[Listener] = []

    # ----- events -----
    def add_listener(self, listener: Listener) -> None:
        if listener not in self._listeners:
            self._listeners.append(listener)

    def emit(self, event: str, data: dict) -> None:
        for listener in list(self._listeners):
            try:
                listener(event, data)
            except Exception:  # a broken panel must never break sampling
                log.exception("ulysses-sp: event listener failed for %s", event)

    def _forward(self, devices: list[str]) -> Callable[[dict], None]:
        """A pool listener: every pool event as 'ulysses_sp.pool', plus the panel's step and state events."""
        def forward(event: dict) -> None:
            self.emit("ulysses_sp.pool", {"devices": devices, **event})
            if event["event"] == "call":
                self.emit("ulysses_sp.step", {"devices": devices, **event})
            elif event["event"] == "state":
                self.emit("ulysses_sp.state", {"devices": devices, "state": event["activity"]})
            elif event["event"] in STATUS_EVENTS:
                self.emit_status()
        return forward

    # ----- pools -----
    def pool_for(self, config: SPConfig):
        """The pool for this layout, started on first use; a different layout on the same devices replaces it."""
        key = tuple(config.devices)
        with self._lock:
            pool = self._pools.get(key)
            if pool is not None and pool.config == config:
                return pool
            if pool is not None:
                log.info("ulysses-sp: layout of %s changes from %s to %s: restarting the pool", list(key),
                         pool.config.layout_name, config.layout_name)
                self._close(key)
            self._close_overlapping(key)
            self.emit("ulysses_sp.state", {"devices": list(key), "state": "starting"})
            pool = self._pools[key] = self._factory(config)
            pool.add_listener(self._forward(list(key)))
        self.emit_status()
        return pool

    def _close_overlapping(self, key: tuple[str, ...]) -> None:
        """A GPU serves one pool: another pool on any of these GPUs is closed first (CPU workers may share)."""
        gpus = {device for device in key if device.startswith("cuda")}
        for other in list(self._pools):
            if gpus & set(other):
                log.info("ulysses-sp: closing the pool on %s to free GPUs for %s", list(other), list(key))
                self._close(other)

    def _close(self, key: tuple[str, ...]) -> bool:
        pool = self._pools.pop(key, None)  # atomic: a loader holding the pool gets PoolClosedError from it
        if pool is None:
            return False
        try:
            pool.close()
        except Exception:
            log.exception("ulysses-sp: closing the pool on %s failed", list(key))
        return True

    # ----- models -----
    def load(self, spec: ModelSpec, progress: Optional[Callable[[float, str], None]] = None, patches=None,
             should_cancel: Optional[Callable[[], bool]] = None):
        """Handle of spec's model with spec's LoRAs and ComfyUI's weight `patches` (a PatchSet) applied, loading
        it in its pool when needed; should_cancel() true stops the load or LoRA change (Cancelled)."""
        with self._lock:
            pool = self.pool_for(spec.config)
            handle = pool.load_model(spec.path, dtype=spec.dtype, progress=progress, should_cancel=should_cancel,
                                     **spec.options)
            pool.set_loras(handle, [list(lora) for lora in spec.loras], progress, patches, should_cancel)
            return handle

    def serving(self, spec: ModelSpec, handle=None, patches=None):
        """The handle a diffusion_model call of spec's model goes through, with ComfyUI's weight `patches` (the pool
        applies them, and the handle's LoRAs, before the call when its workers hold others). `handle` (the one the
        SP MODEL holds) serves while its pool is spec's: no path resolution, stat or header read per call, and it
        loads its model again itself after an unload or a pool restart. Else (none yet, or the pool was closed or
        replaced) spec's model is loaded."""
        with self._lock:
            if handle is None or self._pools.get(spec.devices) is not handle.pool:
                handle = self.load(spec, patches=patches)
            handle.patches = patches
            return handle

    # ----- control: never behind self._lock, which a load holds for as long as it takes -----
    def unload_all(self) -> int:
        """Unload every model in every pool; the pools stay up (a load in progress is stopped, not waited for).
        Returns how many models were unloaded."""
        count = sum(pool.unload_all() for pool in list(self._pools.values()))
        self.emit_status()
        return count

    def shutdown(self, devices: Optional[list[str]] = None) -> int:
        """Close the pool on these devices, or every pool (a load in progress is stopped, not waited for);
        returns how many were closed."""
        keys = [key for key in ([tuple(devices)] if devices else list(self._pools)) if key in self._pools]
        closed = sum(self._close(key) for key in keys)
        self.emit_status()
        return closed

    def close_all(self) -> None:
        for key in list(self._pools):
            self._close(key)

    # ----- status -----
    def status(self) -> dict:
        """JSON-ready view of every pool for the web panel."""
        pools = list(self._pools.values())  # no lock: a load may hold it for minutes, the panel must not wait
        return {"pools": [_pool_view(pool) for pool in pools], "time": time.time()}

    def emit_status(self) -> None:
        if self._listeners:
            self.emit("ulysses_sp.status", self.status())

    @property
    def pool_count(self) -> int:
        return len(self._pools)


def _pool_view(pool) -> dict:
    """One pool for the panel: its layout, and what the pool reports of itself (or the error it raised)."""
    config = pool.config
    try:
        status = pool.status()
    except Exception as error:  # the panel shows the error instead of failing
        status = {"error": str(error)}
    return {"devices": list(config.devices), "config": config.to_dict(), "layout": config.layout_name,
            "world_size": config.world_size, "backend": config.backend, "state": status.get("activity", "unknown"),
            "last_step": status.get("last_step"), "models": status.get("models", []), "pool": status}


OWNER = PoolOwner()
atexit.register(OWNER.close_all)
