"""WorkerPool: one persistent worker process per device, models loaded in all of them (with their LoRAs), and calls
delegated to them through shared memory, with fault handling (dead workers, remote exceptions, cancel) and a clean
shutdown.
"""
from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import threading
import time
import weakref
from multiprocessing.connection import wait
from typing import Any, Callable, Optional, Sequence, Union

import torch

from ..config import SPConfig
from ..families.base import Cancelled, LoadRequest, ModelInfo, ProgressFn
from ..lora.spec import LoraList, normalize_loras
from .arena import InputArena, OutputArena
from .control import ControlBlock
from .errors import PoolClosedError, PoolForkedError, PoolStartError, RemoteError, WorkerError
from .handle import ModelHandle
from .ownership import new_token
from .protocol import encode_tree, recv, send
from .segments import claim_names, clean_stale_segments, release_retired
from .spawn import RunFolder, Rendezvous, WorkerProcess, clean_stale_run_dirs, launch_worker, worker_env
from .status import rank_memory

log = logging.getLogger("ulysses_sp.pool")
POLL_S = 0.05
CLOSE_WAIT_S = 10.0  # how long close() waits for a call in another thread before it stops the workers anyway
_live_pools: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()
Listener = Callable[[dict], None]


class WorkerPool:
    """Workers for one SPConfig. Use as a context manager, or call close(); also closed at interpreter exit.

    start_timeout_s: how long workers may take to start and join the process group.
    error_grace_s: after one rank raised, how long the others may take to answer before the pool restarts.
    cancel_grace_s: after a cancel request, how long workers may take to stop before the pool restarts.
    """

    def __init__(self, config: Union[SPConfig, Sequence[str]], *, start_timeout_s: float = 180.0,
                 error_grace_s: float = 3.0, cancel_grace_s: float = 5.0, env: Optional[dict] = None,
                 threads: Optional[int] = None):
        self.config = config if isinstance(config, SPConfig) else SPConfig(devices=list(config))
        self.start_timeout_s = start_timeout_s
        self.error_grace_s = error_grace_s
        self.cancel_grace_s = cancel_grace_s
        self._env, self._threads = env, threads
        self._token = new_token()  # in every shared name: unique even where two processes share a PID
        self._owner_pid = os.getpid()
        self._lock = threading.RLock()
        self._state = "starting"
        self._workers: list[WorkerProcess] = []
        self._rendezvous: Optional[Rendezvous] = None
        self._control: Optional[ControlBlock] = None
        self._names = claim_names(self._token)
        self._inputs = InputArena(self._token)
        self._outputs = OutputArena(self._token)
        self._models: dict[str, tuple[LoadRequest, ModelInfo]] = {}  # loaded by the user and not unloaded
        self._resident: set[str] = set()          # resident in the current workers
        self._applied_loras: dict[str, Optional[LoraList]] = {}  # in the current workers; None: unknown (failed)
        self._listeners: list[Listener] = []
        self._ids = itertools.count(1)
        self._run = RunFolder(self._token)
        self.restarts = 0
        self.stats = {"calls": 0, "last_call_s": None, "last_worker_s": None, "last_bytes_copied": 0,
                      "last_conditioning_bytes_copied": 0, "last_copied": {}, "bytes_copied_total": 0}
        self._ranks = [{"calls": 0, "last_call_s": None, "memory": {}} for _ in self.config.devices]
        atexit.register(_close_at_exit, weakref.ref(self))
        _live_pools.add(self)
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    # ---- public API -----------------------------------------------------------------------------------------
    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def state(self) -> str:
        return self._state

    @property
    def worker_pids(self) -> list[int]:
        return [worker.pid for worker in self._workers]

    @property
    def log_dir(self) -> str:
        return self._run.path

    def add_listener(self, listener: Listener) -> None:
        """listener(event: dict) is called (in the calling thread) on state changes, calls, loads and faults."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def load_model(self, path: Union[str, os.PathLike], dtype: Union[torch.dtype, str, None] = "default",
                   progress: Optional[ProgressFn] = None, **options: Any) -> ModelHandle:
        """Load a checkpoint in every worker (cached there by path, dtype and options) and return its handle."""
        request = _load_request(path, dtype, options)
        with self._lock:
            self._ensure_running()
            info = self._make_resident(request, progress)
        return ModelHandle(self, request, info)

    def set_loras(self, handle: ModelHandle, loras: Sequence, progress: Optional[ProgressFn] = None) -> dict:
        """Apply LoRAs [[path, strength], ...] to a loaded model in every worker, replacing its previous list.

        Afterwards the weights are base + sum of strength x delta (in list order); [] or strength 0 give the base
        weights back exactly. The workers read the files; only the parameters whose LoRAs change are rewritten.
        The handle remembers the list: calls through it re-apply it after an unload or a pool restart, and
        switch the workers' copy back to it when another handle of the same model changed it.
        Returns rank 0's summary: {"parameters": patched now, "updated": rewritten by this call, "skipped": [...]}.
        """
        wanted = normalize_loras(loras)
        with self._lock:
            self._ensure_running()
            self._follow_file(handle)
            self._make_resident(handle.request, None)
            summary = self._apply_loras(handle, wanted, progress)
        handle.loras = wanted
        return summary

    def unload(self, model: Union[ModelHandle, str]) -> None:
        """Free a model in the workers now (a later call through a handle to it loads it again)."""
        key = model.key if isinstance(model, ModelHandle) else model
        with self._lock:
            self._models.pop(key, None)
            if key in self._resident and self._state == "idle":
                self._request({"op": "unload", "key": key})
            self._resident.discard(key)
            self._applied_loras.pop(key, None)
        self._emit({"event": "unloaded", "model": key})

    def unload_all(self) -> None:
        with self._lock:
            if self._resident and self._state == "idle":
                self._request({"op": "unload", "all": True})
            self._models.clear()
            self._resident.clear()
            self._applied_loras.clear()
        self._emit({"event": "unloaded", "model": None})

    def is_loaded(self, model: Union[ModelHandle, str]) -> bool:
        return (model.key if isinstance(model, ModelHandle) else model) in self._resident

    def run(self, handle: ModelHandle, x: torch.Tensor, timestep: torch.Tensor, kwargs: dict,
            should_cancel: Optional[Callable[[], bool]] = None) -> torch.Tensor:
        """One forward of a loaded model (use the handle: it validates the arguments first)."""
        with self._lock:
            self._ensure_running()
            self._follow_file(handle)
            self._make_resident(handle.request, None)
            if self._applied_loras.get(handle.key) != handle.loras:
                self._apply_loras(handle, handle.loras, None)
            if should_cancel is not None and should_cancel():
                raise Cancelled("cancelled before the call was sent to the workers")
            return self._call(handle, x, timestep, kwargs, should_cancel)

    def status(self) -> dict:
        """JSON-ready snapshot: layout, state, per-rank device / pid / memory / models / calls, and call stats."""
        workers = list(self._workers)
        ranks = []
        for rank, device in enumerate(self.config.devices):
            worker = workers[rank] if rank < len(workers) else None
            alive = worker is not None and worker.alive()
            ranks.append({"rank": rank, "device": device, "pid": worker.pid if worker else None, "alive": alive,
                          "memory": rank_memory(device, worker.pid if alive else None, self._ranks[rank]["memory"]),
                          "models": [_model_summary(*self._models[key]) for key in sorted(self._resident)
                                     if key in self._models and alive],
                          "calls": self._ranks[rank]["calls"],
                          "last_call_s": self._ranks[rank]["last_call_s"],
                          "blocks_done": self._control.counter(rank) if self._control and alive else None})
        return {"state": self._state, "config": self.config.to_dict(), "layout": self.config.layout_name,
                "backend": self.config.backend, "world_size": self.config.world_size, "restarts": self.restarts,
                "log_dir": self._run.path, "models": [_model_entry(request, info, key in self._resident,
                                                                  self._applied_loras.get(key))
                                                     for key, (request, info) in self._models.items()],
                "shared_memory": self.segment_names(), "ranks": ranks, **self.stats}

    def segment_names(self) -> list[str]:
        """Names of this pool's shared-memory segments (control, input and output arenas)."""
        parts = (self._control, self._inputs, self._outputs)
        return [part.segment.name for part in parts if part is not None and part.segment is not None]

    def close(self) -> None:
        """End and reap every worker and unlink every shared-memory segment. Idempotent."""
        if self._owner_pid != os.getpid():
            return  # a forked child: the workers, segments and folder are its parent's
        # A call stuck in another thread must not block shutdown (e.g. at interpreter exit): go on without the lock.
        locked = self._lock.acquire(timeout=CLOSE_WAIT_S)
        try:
            if self._state == "closed":
                return
            self._set_state("closed")
            self._stop_workers(graceful=True)
            for part in (self._inputs, self._outputs, self._control):
                if part is not None:
                    part.release()
            self._control = None
            release_retired()
            self._run.remove()
            if self._names is not None:
                self._names.release()
        finally:
            if locked:
                self._lock.release()

    def _after_fork_in_child(self) -> None:
        """Let go of what the parent owns: its workers' pipes, owner files and lock (held maybe by a thread that
        does not exist here); close() then does nothing here and every call raises PoolForkedError."""
        self._lock = threading.RLock()
        self._state = "forked"
        for worker in self._workers:
            worker.conn.close()
        self._run.forget()
        if self._names is not None:
            self._names.forget()

    # ---- start, restart, stop -------------------------------------------------------------------------------
    def _start(self) -> None:
        self._set_state("starting")
        clean_stale_segments()
        clean_stale_run_dirs()
        run_dir = self._run.ensure()
        if self._control is None:
            self._control = ControlBlock.create(self._token, self.config.world_size)
        self._rendezvous = Rendezvous(run_dir)
        spec = {"config": self.config.to_dict(), "parent_pid": os.getpid(), "control": self._control.name,
                "store_path": self._rendezvous.path, "timeout_s": self.start_timeout_s, "threads": self._threads}
        env = worker_env(self._env)
        try:
            for rank, device in enumerate(self.config.devices):
                self._workers.append(launch_worker(rank, device, spec, env, run_dir))
            self._await_ready()
        except BaseException:
            self._stop_workers(graceful=False)
            self._set_state("broken")
            raise
        self._resident.clear()
        self._set_state("idle")

    def _await_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        waiting = {worker.conn: worker for worker in self._workers}
        while waiting:
            for conn in wait(list(waiting), timeout=POLL_S):
                worker = waiting[conn]
                try:
                    message = recv(conn)
                except (EOFError, OSError):
                    raise self._start_error(worker, f"the process {worker.exit_cause(wait_s=2.0)} before it "
                                                    f"was ready") from None
                if message.get("event") == "start_failed":
                    raise self._start_error(worker, message["message"], message.get("traceback", ""))
                if message.get("event") == "ready":
                    worker.ready = True
                    self._ranks[worker.rank]["memory"] = message.get("memory", {})
                    del waiting[conn]
            for worker in list(waiting.values()):
                if not worker.alive():
                    raise self._start_error(worker, f"the process {worker.exit_cause()} before it was ready")
            if waiting and time.monotonic() > deadline:
                late = sorted(waiting.values(), key=lambda w: w.rank)
                raise PoolStartError(
                    f"workers {[(w.rank, w.device) for w in late]} did not start within {self.start_timeout_s:g} s "
                    f"(raise start_timeout_s if the machine is slow)\n" + _tail_of(late[0], inline=True),
                    late[0].rank, late[0].device)

    def _start_error(self, worker: WorkerProcess, cause: str, remote_traceback: str = "") -> PoolStartError:
        # inline: a pool that cannot start is closed, and its log folder with it
        detail = remote_traceback if remote_traceback else _tail_of(worker, inline=True)
        return PoolStartError(f"worker rank {worker.rank} on {worker.device} could not start: {cause}"
                              + (f"\n{detail}" if detail else ""), worker.rank, worker.device)

    def _ensure_running(self) -> None:
        if self._owner_pid != os.getpid():
            raise PoolForkedError(f"this WorkerPool belongs to process {self._owner_pid}; a forked child (pid "
                                  f"{os.getpid()}) cannot use its workers: create a new WorkerPool in the child")
        if self._state == "closed":
            raise PoolClosedError("the worker pool is closed: create a new WorkerPool")
        dead = [worker for worker in self._workers if not worker.alive()]
        if dead:
            for worker in dead:
                self._emit({"event": "worker_died", "rank": worker.rank, "device": worker.device,
                            "cause": worker.exit_cause()})
            self._state = "broken"
        if self._state == "broken":
            self._stop_workers(graceful=False)
            self.restarts += 1
            log.warning("restarting the worker pool (%s)", self.config.layout_name)
            self._start()
            self._emit({"event": "restarted", "restarts": self.restarts})

    def _break(self, reason: str) -> None:
        """Kill the workers (some may hang in a collective); the next call or load restarts the pool."""
        log.warning("worker pool broken: %s", reason)
        self._stop_workers(graceful=False)
        self._set_state("broken")

    def _stop_workers(self, graceful: bool) -> None:
        workers, self._workers = self._workers, []
        for worker in workers:
            if graceful and worker.alive():
                try:
                    send(worker.conn, {"op": "exit", "id": 0})
                except OSError:
                    pass
            else:
                worker.kill()
        deadline = time.monotonic() + (5.0 if graceful else 0.0)
        for worker in workers:
            worker.reap(wait_s=max(0.0, deadline - time.monotonic()) if graceful else 5.0)
        if self._rendezvous is not None:
            self._rendezvous.close()
            self._rendezvous = None
        self._resident.clear()
        self._applied_loras.clear()

    # ---- requests -------------------------------------------------------------------------------------------
    def _make_resident(self, request: LoadRequest, progress: Optional[ProgressFn]) -> ModelInfo:
        if request.key not in self._resident:
            replies = self._request({"op": "load", "request": request.to_message()},
                                    on_progress=self._progress_relay(request, progress))
            infos = [reply["info"] for reply in replies]
            if any(info != infos[0] for info in infos):
                self._break("ranks loaded different models")
                raise WorkerError(f"the ranks disagree about {request.path}: {infos}")
            self._drop_superseded(request)
            self._models[request.key] = (request, ModelInfo(**infos[0]))
            self._resident.add(request.key)
            self._applied_loras[request.key] = ()  # freshly loaded: base weights
            self._emit({"event": "loaded", "model": _model_entry(request, self._models[request.key][1], True)})
        return self._models[request.key][1]

    def _drop_superseded(self, request: LoadRequest) -> None:
        """Unload the copies of this model made from its file as it was before it changed on disk."""
        for key, (other, _) in list(self._models.items()):
            if key != request.key and (other.path, other.dtype, other.options) == \
                    (request.path, request.dtype, request.options):
                self.unload(key)

    def _follow_file(self, handle: ModelHandle) -> None:
        """A handle whose model must be loaded again loads its file as it is now (replaced on disk: new weights)."""
        if handle.key not in self._resident:
            current = _load_request(handle.path, handle.dtype, handle.request.options)
            if current.key != handle.key:
                log.warning("%s changed on disk since it was loaded: loading it as it is now", handle.path)
                handle.request, handle.info = current, self._make_resident(current, None)

    def _apply_loras(self, handle: ModelHandle, loras: LoraList, progress: Optional[ProgressFn]) -> dict:
        key = handle.key
        self._applied_loras[key] = None  # a failure part-way leaves the workers' state unknown until it succeeds
        replies = self._request({"op": "set_loras", "key": key, "loras": [list(lora) for lora in loras]},
                                on_progress=_quiet(progress))
        self._applied_loras[key] = loras
        summary = replies[0]
        if summary.get("skipped"):
            log.warning("LoRA modules for the text encoder were skipped (the diffusion model has no such weights): "
                        "%s", summary["skipped"][:8])
        self._emit({"event": "loras", "model": handle.path, "loras": [list(lora) for lora in loras],
                    "updated": summary.get("updated")})
        return {name: summary.get(name) for name in ("parameters", "updated", "skipped")}

    def _progress_relay(self, request: LoadRequest, progress: Optional[ProgressFn]):
        def relay(fraction: float, message: str) -> None:
            if progress is not None:
                try:
                    progress(fraction, message)
                except Exception:  # noqa: BLE001 - a display callback must not abort a load on every rank
                    log.exception("load progress callback failed")
            self._emit({"event": "load_progress", "model": request.path, "fraction": fraction, "message": message})
        return relay

    def _call(self, handle: ModelHandle, x: torch.Tensor, timestep: torch.Tensor, kwargs: dict,
              should_cancel: Optional[Callable[[], bool]]) -> torch.Tensor:
        started = time.perf_counter()
        tensors: dict[str, torch.Tensor] = {}
        args = {"x": encode_tree(x, "x", tensors), "timestep": encode_tree(timestep, "timestep", tensors),
                "kwargs": {"dict": {key: encode_tree(value, key, tensors) for key, value in kwargs.items()}}}
        with torch.no_grad():
            specs, copied = self._inputs.stage(tensors, always_copy=frozenset({"x"}))
        region = self._outputs.region(x.dtype, handle.info.output_shape(tuple(x.shape)))
        self._control.set_cancel(False)
        self._control.reset_counters(self.config.world_size)
        message = {"op": "call", "key": handle.key, "input_segment": self._inputs.segment.name, "tensors": specs,
                   "live": self._inputs.live_versions(), "args": args, "output": region}
        replies = self._request(message, should_cancel=should_cancel)
        out = self._outputs.read(region, x.dtype)
        self._record_call(time.perf_counter() - started, copied, replies, handle)
        return out

    def _record_call(self, seconds: float, copied: dict, replies: list[dict], handle: ModelHandle) -> None:
        conditioning = sum(n for name, n in copied.items() if name not in ("x", "timestep"))
        worker_s = max(reply.get("seconds", 0.0) for reply in replies)
        self.stats.update(calls=self.stats["calls"] + 1, last_call_s=seconds, last_worker_s=worker_s,
                          last_copied=dict(copied),
                          last_bytes_copied=sum(copied.values()), last_conditioning_bytes_copied=conditioning,
                          bytes_copied_total=self.stats["bytes_copied_total"] + sum(copied.values()))
        for rank, reply in enumerate(replies):
            self._ranks[rank]["calls"] += 1
            self._ranks[rank]["last_call_s"] = reply.get("seconds")
        self._emit({"event": "call", "model": handle.path, "seconds": seconds,
                    "worker_seconds": worker_s,
                    "bytes_copied": sum(copied.values()), "conditioning_bytes_copied": conditioning})

    def _request(self, message: dict, should_cancel: Optional[Callable[[], bool]] = None,
                 on_progress: Optional[ProgressFn] = None) -> list[dict]:
        """Send one request to every worker and wait for all replies; raise on any failure."""
        message["id"] = next(self._ids)
        self._set_state("busy")
        try:
            for worker in self._workers:
                try:
                    send(worker.conn, message)
                except OSError:
                    raise self._worker_died(worker, message["op"]) from None
            replies, cancelled = self._collect(message, should_cancel, on_progress)
        except (WorkerError, Cancelled):
            raise
        except BaseException:  # e.g. KeyboardInterrupt while waiting: the workers are mid-call
            self._break(f"interrupted while waiting for the workers ({message['op']})")
            raise
        self._set_state("idle")
        self._raise_failures(replies, message["op"])
        if cancelled:
            raise Cancelled("cancelled by the caller (the call finished before the workers saw it)")
        for rank, reply in enumerate(replies):
            if reply.get("memory"):
                self._ranks[rank]["memory"] = reply["memory"]
        return replies

    def _collect(self, message: dict, should_cancel, on_progress) -> tuple[list[dict], bool]:
        pending = {worker.conn: worker for worker in self._workers}
        replies: dict[int, dict] = {}
        failed_at = cancel_at = None
        while pending:
            for conn in wait(list(pending), timeout=POLL_S):
                worker = pending[conn]
                try:
                    reply = recv(conn)
                except (EOFError, OSError):
                    raise self._worker_died(worker, message["op"]) from None
                if "progress" in reply:
                    if on_progress is not None and reply.get("id") == message["id"]:
                        on_progress(reply["progress"], reply.get("message", ""))
                elif reply.get("id") == message["id"]:
                    replies[worker.rank] = reply
                    del pending[conn]
            for worker in pending.values():
                if not worker.alive():
                    raise self._worker_died(worker, message["op"])
            now = time.monotonic()
            if pending and any(not reply["ok"] for reply in replies.values()):
                failed_at = failed_at or now
                if now - failed_at > self.error_grace_s:
                    self._break(f"ranks {sorted(w.rank for w in pending.values())} did not answer after another "
                                f"rank failed")
                    raise self._remote_error(replies, message["op"], restarted=True)
            if cancel_at is None and should_cancel is not None and pending and should_cancel():
                self._control.set_cancel(True)
                cancel_at = now
            if pending and cancel_at is not None and now - cancel_at > self.cancel_grace_s:
                self._break(f"the workers did not stop within {self.cancel_grace_s:.0f} s of a cancel")
                raise Cancelled(f"cancelled; the workers did not stop within {self.cancel_grace_s:.0f} s, so the "
                                f"pool restarts on the next call")
        return [replies[rank] for rank in range(len(replies))], cancel_at is not None

    def _raise_failures(self, replies: list[dict], op: str) -> None:
        errors = {rank: reply for rank, reply in enumerate(replies) if not reply["ok"]}
        if not errors:
            return
        if all(reply["error"] == "Cancelled" for reply in errors.values()) and len(errors) == len(replies):
            raise Cancelled(errors[0]["message"])
        # Ranks that failed differently (or not at all) may disagree about which collectives ran: restart.
        consistent = len(errors) == len(replies) and len({reply["error"] for reply in errors.values()}) == 1
        if not consistent:
            self._break(f"ranks {sorted(errors)} of {len(replies)} failed during {op}")
        raise self._remote_error(errors, op, restarted=not consistent)

    def _remote_error(self, replies: dict[int, dict], op: str, restarted: bool) -> RemoteError:
        rank, reply = next((rank, reply) for rank, reply in sorted(replies.items()) if not reply["ok"])
        device = self.config.devices[rank]
        text = f"worker rank {rank} on {device} failed during {op}: {reply['error']}: {reply['message']}"
        if reply.get("oom"):
            text += (f"\nout of memory on {device}: lower the resolution, frame count or batch, use more devices, "
                     f"or load the weights in a smaller dtype (bf16 / fp8)")
            if device == "cpu":
                text += "; every CPU worker holds its own copy of the weights: free RAM or use fewer CPU workers"
        if restarted:
            text += "\n(the other ranks could not finish, so the pool restarts on the next call)"
        text += f"\n--- worker traceback (rank {rank}) ---\n{reply.get('traceback', '')}"
        return RemoteError(text, rank, device, reply["error"], reply["message"], reply.get("traceback", ""))

    def _worker_died(self, worker: WorkerProcess, op: str) -> WorkerError:
        if self._state == "closed":  # close() in another thread stopped it: not a crash, not the OOM killer
            return PoolClosedError(f"the worker pool was closed during {op}")
        cause = worker.exit_cause(wait_s=2.0)
        tail = _tail_of(worker)
        self._emit({"event": "worker_died", "rank": worker.rank, "device": worker.device, "cause": cause})
        self._break(f"rank {worker.rank} died")
        return WorkerError(f"worker rank {worker.rank} on {worker.device} (pid {worker.pid}) died during {op}: "
                           f"{cause}; the pool restarts on the next call" + (f"\n{tail}" if tail else ""),
                           worker.rank, worker.device)

    # ---- events ---------------------------------------------------------------------------------------------
    def _set_state(self, state: str) -> None:
        if state != self._state and self._state != "closed":  # closed is final, even if a call fails after it
            self._state = state
            self._emit({"event": "state", "state": state})

    def _emit(self, event: dict) -> None:
        event.setdefault("time", time.time())
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:  # noqa: BLE001 - a listener never breaks the pool
                log.exception("pool listener %r failed on %s", listener, event.get("event"))

    def __deepcopy__(self, memo: dict) -> "WorkerPool":
        return self  # one set of worker processes: a copy of anything that refers to the pool shares it

    def __repr__(self) -> str:
        return f"WorkerPool({list(self.config.devices)}, layout={self.config.layout_name}, state={self._state})"


def _load_request(path, dtype, options: dict) -> LoadRequest:
    """The request with the checkpoint's header, read once here: a file that is not a checkpoint of a known family
    fails now, before any worker reads it, and the workers do not read the header again. Its key is the model's
    identity: the resolved path (one model through any symlink), the dtype "default" stands for, the options, and
    the files' stamp (a file replaced on disk is another model)."""
    from ..families.checkpoint import resolved_dtype_name
    from ..families.detect import detect
    from ..families.header import checkpoint_stamp, read_checkpoint_header
    path = os.path.realpath(os.path.expanduser(os.fspath(path)))
    header = read_checkpoint_header(path)
    detection = detect(header)
    try:
        json.dumps(options)
    except TypeError as error:
        raise ValueError(f"load options must be JSON values (numbers, strings, lists, dicts): {error}") from None
    dtype = resolved_dtype_name(dtype, header, detection.prefix)
    return LoadRequest(path, dtype, dict(options), header, checkpoint_stamp(path))


def _model_entry(request: LoadRequest, info: ModelInfo, resident: bool,
                 loras: Optional[LoraList] = ()) -> dict:
    return {"key": request.key, "path": request.path, "dtype": request.dtype, "options": request.options,
            "resident": resident, "loras": [list(lora) for lora in loras or ()], **info.to_dict()}


def _model_summary(request: LoadRequest, info: ModelInfo) -> dict:
    return {"path": request.path, "family": info.family, "variant": info.variant, "dtype": info.weight_dtype}


def _quiet(progress: Optional[ProgressFn]) -> Optional[ProgressFn]:
    """A progress callback whose failures are logged, never raised into a request on every rank."""
    if progress is None:
        return None

    def relay(fraction: float, message: str) -> None:
        try:
            progress(fraction, message)
        except Exception:  # noqa: BLE001 - a display callback must not abort the request
            log.exception("progress callback failed")
    return relay


def _tail_of(worker: WorkerProcess, inline: bool = False) -> str:
    """The end of a worker's log; inline: named without its path (for errors raised after the folder is gone)."""
    tail = worker.log_tail()
    name = f"rank {worker.rank}'s log" if inline else worker.log_path
    return f"--- last lines of {name} ---\n{tail}" if tail else ""


def _close_at_exit(pool_ref) -> None:
    pool = pool_ref()
    if pool is not None:
        pool.close()


def _forget_pools_in_child() -> None:
    for pool in list(_live_pools):
        pool._after_fork_in_child()


os.register_at_fork(after_in_child=_forget_pools_in_child)
