"""The one owner of every worker pool in the ComfyUI process: one pool per device set, reused across prompts and
loaders, models loaded on demand, LoRA sets kept in step, step times recorded, events sent to listeners.

Nodes hold no state: they describe what they want with a ModelSpec and ask OWNER for it. No ComfyUI import here.
"""
from __future__ import annotations

import atexit
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from sp_runtime.config import SPConfig

log = logging.getLogger("ulysses_sp")
Listener = Callable[[str, dict], None]
STATUS_EVENTS = {"loaded", "unloaded", "worker_died", "restarted"}  # pool events that change the panel's picture
STEP_HISTORY = 64  # recent step times kept per (model, shape, layout) for the panel's speed-up figure


@dataclass(frozen=True)
class ModelSpec:
    """Everything that identifies one SP model: pool layout, file, dtype, options, and the LoRAs applied on top."""

    devices: tuple[str, ...]
    ulysses_degree: int
    ring_degree: int
    cfg_degree: int
    path: str
    dtype: str = "default"
    options_json: str = "{}"
    loras: tuple[tuple[str, float], ...] = ()

    @classmethod
    def create(cls, config: SPConfig, path: str, dtype: str = "default", options: Optional[dict] = None,
               loras: tuple = ()) -> "ModelSpec":
        return cls(tuple(config.devices), config.ulysses_degree, config.ring_degree, config.cfg_degree, path,
                   dtype, json.dumps(options or {}, sort_keys=True), tuple(loras))

    @property
    def config(self) -> SPConfig:
        return SPConfig(devices=list(self.devices), ulysses_degree=self.ulysses_degree,
                        ring_degree=self.ring_degree, cfg_degree=self.cfg_degree)

    @property
    def options(self) -> dict:
        return json.loads(self.options_json)

    @property
    def weights_key(self) -> tuple:
        """Models that differ only in LoRAs share one loaded copy in the workers."""
        return (self.path, self.dtype, self.options_json)

    def with_lora(self, lora_path: str, strength: float) -> "ModelSpec":
        return ModelSpec(self.devices, self.ulysses_degree, self.ring_degree, self.cfg_degree, self.path,
                         self.dtype, self.options_json, self.loras + ((lora_path, float(strength)),))


@dataclass
class _PoolEntry:
    config: SPConfig
    pool: Any
    handles: dict = field(default_factory=dict)        # weights_key -> handle
    applied_loras: dict = field(default_factory=dict)  # weights_key -> tuple of (path, strength) in the workers
    state: str = "idle"
    last_step: Optional[dict] = None


def _default_pool_factory(config: SPConfig):
    from sp_runtime import WorkerPool
    return WorkerPool(config)


class PoolOwner:
    """Thread-safe registry of pools keyed by device set; the ComfyUI execution thread and the server both use it."""

    def __init__(self, pool_factory: Callable[[SPConfig], Any] = _default_pool_factory):
        self._factory = pool_factory
        self._pools: dict[tuple[str, ...], _PoolEntry] = {}
        self._lock = threading.RLock()
        self._listeners: list[Listener] = []
        self._steps: dict[tuple, list[float]] = {}

    # ----- events -----
    def add_listener(self, listener: Listener) -> None:
        if listener not in self._listeners:
            self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def emit(self, event: str, data: dict) -> None:
        for listener in list(self._listeners):
            try:
                listener(event, data)
            except Exception:  # a broken panel must never break sampling
                log.exception("ulysses-sp: event listener failed for %s", event)

    # ----- pools -----
    def pool_for(self, config: SPConfig):
        """The pool for this layout, started on first use; a different layout on the same devices replaces it."""
        key = tuple(config.devices)
        with self._lock:
            entry = self._pools.get(key)
            if entry is not None and entry.config == config:
                return entry
            if entry is not None:
                log.info("ulysses-sp: layout of %s changes from %s to %s: restarting the pool", list(key),
                         entry.config.layout_name, config.layout_name)
                self._close_entry(key)
            self._close_overlapping(key)
            self.emit("ulysses_sp.state", {"devices": list(key), "state": "starting"})
            entry = _PoolEntry(config, self._factory(config))
            self._pools[key] = entry
            self._attach_pool_events(entry)
        self.emit_status()
        return entry

    def _close_overlapping(self, key: tuple[str, ...]) -> None:
        """A GPU serves one pool: another pool on any of these GPUs is closed first (CPU workers may share)."""
        gpus = {device for device in key if device.startswith("cuda")}
        for other in list(self._pools):
            if gpus & set(other):
                log.info("ulysses-sp: closing the pool on %s to free GPUs for %s", list(other), list(key))
                self._close_entry(other)

    def _attach_pool_events(self, entry: _PoolEntry) -> None:
        """Forward the pool's own events (state, loaded, call, worker_died, ...) as 'ulysses_sp.pool'."""
        add = getattr(entry.pool, "add_listener", None)
        if not callable(add):
            return
        devices = list(entry.config.devices)

        def forward(event: dict) -> None:
            self.emit("ulysses_sp.pool", {"devices": devices, **event})
            if event.get("event") in STATUS_EVENTS:
                self.emit_status()
        add(forward)

    def _close_entry(self, key: tuple[str, ...]) -> None:
        entry = self._pools.pop(key, None)
        if entry is None:
            return
        try:
            entry.pool.close()
        except Exception:
            log.exception("ulysses-sp: closing the pool on %s failed", list(key))

    # ----- models -----
    def load(self, spec: ModelSpec, progress: Optional[Callable[[float, str], None]] = None):
        """Handle of spec's model in its pool, loading it (and syncing its LoRAs) when needed."""
        with self._lock:
            entry = self.pool_for(spec.config)
            handle = entry.handles.get(spec.weights_key)
            if handle is None:
                entry.state = "loading"
                self.emit("ulysses_sp.state", {"devices": list(spec.devices), "state": "loading",
                                               "model": spec.path})
                try:
                    handle = entry.pool.load_model(spec.path, dtype=spec.dtype, progress=progress, **spec.options)
                finally:
                    entry.state = "idle"
                entry.handles[spec.weights_key] = handle
                entry.applied_loras[spec.weights_key] = ()
                self.emit_status()
            self._sync_loras(entry, spec, handle)
            return handle

    def _sync_loras(self, entry: _PoolEntry, spec: ModelSpec, handle) -> None:
        if entry.applied_loras.get(spec.weights_key, ()) == spec.loras:
            return
        setter = getattr(entry.pool, "set_loras", None)
        if not callable(setter):
            raise RuntimeError("this ulysses-sp worker pool cannot apply LoRAs yet (WorkerPool.set_loras is "
                               "missing); remove the 'LoRA (Ulysses SP)' node or update ulysses-sp")
        setter(handle, [list(lora) for lora in spec.loras])
        entry.applied_loras[spec.weights_key] = spec.loras

    def call(self, spec: ModelSpec, x, timestep, context=None, should_cancel=None, **extra):
        """One diffusion_model call through the pool; records the step time for the panel."""
        handle = self.load(spec)
        with self._lock:
            entry = self._pools[tuple(spec.devices)]
            entry.state = "sampling"
        started = time.perf_counter()
        try:
            out = handle(x, timestep, context=context, should_cancel=should_cancel, **extra)
        except BaseException:
            entry.state = "idle"
            self.emit("ulysses_sp.state", {"devices": list(spec.devices), "state": "idle"})
            raise
        seconds = time.perf_counter() - started
        entry.state = "idle"
        self._record_step(entry, spec, tuple(x.shape), seconds)
        return out

    def _record_step(self, entry: _PoolEntry, spec: ModelSpec, shape: tuple, seconds: float) -> None:
        layout = entry.config.layout_name
        history = self._steps.setdefault((spec.weights_key, shape, layout), [])
        history.append(seconds)
        del history[:-STEP_HISTORY]
        step = {"devices": list(spec.devices), "model": spec.path, "shape": list(shape), "layout": layout,
                "world_size": entry.config.world_size, "seconds": seconds,
                "speedup": self.speedup(spec.weights_key, shape, layout)}
        entry.last_step = step
        self.emit("ulysses_sp.step", step)

    def speedup(self, weights_key: tuple, shape: tuple, layout: str) -> Optional[float]:
        """Median single-device step time over median step time at `layout`, when both were measured here."""
        single = self._steps.get((weights_key, shape, "1"))
        here = self._steps.get((weights_key, shape, layout))
        if not single or not here:
            return None
        return _median(single) / _median(here)

    # ----- control -----
    def unload_all(self) -> int:
        """Unload every model in every pool; the pools stay up. Returns how many models were unloaded."""
        count = 0
        with self._lock:
            for entry in self._pools.values():
                for key, handle in list(entry.handles.items()):
                    entry.pool.unload(handle)
                    entry.handles.pop(key)
                    entry.applied_loras.pop(key, None)
                    count += 1
        self.emit_status()
        return count

    def shutdown(self, devices: Optional[list[str]] = None) -> int:
        """Close the pool on these devices, or every pool; returns how many were closed."""
        with self._lock:
            keys = [tuple(devices)] if devices else list(self._pools)
            closed = 0
            for key in keys:
                if key in self._pools:
                    self._close_entry(key)
                    closed += 1
        self.emit_status()
        return closed

    def close_all(self) -> None:
        with self._lock:
            for key in list(self._pools):
                self._close_entry(key)

    # ----- status -----
    def status(self) -> dict:
        """JSON-ready view of every pool for the web panel."""
        entries = list(self._pools.values())  # no lock: a load may hold it for minutes, the panel must not wait
        pools = []
        for entry in entries:
            try:
                pool_status = entry.pool.status()
            except Exception as error:  # the panel shows the error instead of failing
                pool_status = {"error": str(error)}
            pools.append({"devices": list(entry.config.devices), "config": entry.config.to_dict(),
                          "layout": entry.config.layout_name, "world_size": entry.config.world_size,
                          "backend": entry.config.backend, "state": entry.state,
                          "models": [{"path": key[0], "dtype": key[1], "options": json.loads(key[2]),
                                      "loras": [list(lora) for lora in entry.applied_loras.get(key, ())]}
                                     for key in entry.handles],
                          "last_step": entry.last_step, "pool": pool_status})
        return {"pools": pools, "time": time.time()}

    def emit_status(self) -> None:
        if self._listeners:
            self.emit("ulysses_sp.status", self.status())

    @property
    def pool_count(self) -> int:
        return len(self._pools)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


OWNER = PoolOwner()
atexit.register(OWNER.close_all)
