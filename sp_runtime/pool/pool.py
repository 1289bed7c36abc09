"""WorkerPool: one persistent worker process per device, the models loaded in all of them (with their LoRAs), their
step history and events, calls delegated through shared memory, restarts after faults and a clean shutdown.
How one request reaches the workers and how its failures are worded is in requests.py.
"""
from __future__ import annotations

import contextlib
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
from ..devices import local_device, machine_of
from ..contract import Cancelled, LoadRequest, ModelInfo
from ..checkpoints.loading import ProgressFn
from ..checkpoints.header import checkpoint_stamp, read_checkpoint_header
from ..lora.patch_set import PatchSet
from ..lora.spec import LoraList, normalize_loras
from .arena import InputArena, OutputArena
from .control import ControlBlock
from .errors import PoolClosedError, PoolForkedError, PoolStartError, RemoteError, WorkerError
from .handle import ModelHandle
from .ownership import OwnerLock, new_token
from .patch_transport import KeptSets, stage_patch_set
from .protocol import recv, send
from .requests import POLL_S, Exchange, Timeouts, call_message, tail_of
from .segments import claim_names, clean_stale_segments, fresh_name, release_retired
from .shared_weights import can_share, remove_chunks
from .spawn import RunFolder, Rendezvous, WorkerProcess, clean_stale_run_dirs, launch_worker, worker_env
from .status import machines as machine_summary, rank_memory
from .steps import STEPS, StepHistory

log = logging.getLogger("ulysses_sp.pool")
COLLECTIVE_TIMEOUT_S = 300.0
CLOSE_WAIT_S = 10.0  # how long close() waits for a call in another thread before it stops the workers anyway
_live_pools: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()  # for the fork hook
Listener = Callable[[dict], None]
ACTIVITY = {"load": "loading", "call": "sampling", "set_loras": "applying LoRAs", "unload": "unloading"}
LOADS = frozenset({"load", "set_loras"})  # what Unload interrupts (close interrupts every request)


class WorkerPool:
    """Workers for one SPConfig. Use as a context manager, or call close(); also closed at interpreter exit.

    start_timeout_s: how long workers may take to start and join the process group.
    error_grace_s: after one rank raised, how long the others may take to answer before the pool restarts.
    cancel_grace_s: after a cancel, how long the workers may show no progress (no block check passed, no CPU
        worker computing) before the pool restarts (longer, two of the slowest blocks measured, when blocks are
        slow); CPU workers that compute a slow block are waited for.
    watchdog_s: a rank that shows no sign of life for this long during a request fails it (and the pool restarts).
    stall_s: a call in which no block passes and no CPU worker computes for this long (or 4 of the slowest blocks
        measured, if longer) fails as wedged (and the pool restarts): a rank stuck before a collective that the
        others wait in, found long before collective_timeout_s.
    collective_timeout_s: the process group's timeout for one collective (a rank wedged inside one).
    share_cpu_weights: CPU workers keep one shared copy of each model's weights (Linux /dev/shm), not one each.
    listen, token_file: for devices on joined machines ("node2:cuda:0"): the address the join listener takes
        (127.0.0.1 unless an interface is named; port 0: any free one, see join_address) and the shared secret's
        file (required); default: ULYSSES_SP_LISTEN, ULYSSES_SP_TOKEN_FILE. ulysses_across_machines: allow Ulysses groups that span machines (slow: refused unless
        set, then warned about). docs/MULTI_MACHINE.md.
    A pool dropped without close() is closed when it is garbage-collected, and at interpreter exit.
    """

    def __init__(self, config: Union[SPConfig, Sequence[str]], *, start_timeout_s: float = 180.0,
                 error_grace_s: float = 3.0, cancel_grace_s: float = 5.0, watchdog_s: float = 20.0,
                 stall_s: float = 60.0, collective_timeout_s: float = COLLECTIVE_TIMEOUT_S, env: Optional[dict] = None,
                 threads: Optional[int] = None, steps: StepHistory = STEPS, share_cpu_weights: bool = True,
                 listen: Optional[str] = None, token_file: Optional[str] = None,
                 ulysses_across_machines: bool = False):
        self.config = config if isinstance(config, SPConfig) else SPConfig(devices=list(config))
        check_machine_layout(self.config, ulysses_across_machines)
        self.start_timeout_s = start_timeout_s
        self.collective_timeout_s = collective_timeout_s
        self.share_cpu_weights = share_cpu_weights
        self.timeouts = Timeouts(error_grace_s, cancel_grace_s, watchdog_s, stall_s)
        self._env, self._threads = env, threads
        self._token = new_token()  # in every shared name: unique even where two processes share a PID
        self._owner_pid = os.getpid()
        self._lock = threading.RLock()
        self._interrupted: frozenset = frozenset()  # ops a control call (unload, close) stops while it waits
        self._state, self._activity = "starting", None
        self._workers: list[WorkerProcess] = []  # changed in place: the finalizer holds this list
        self._rendezvous: Optional[Rendezvous] = None
        self._models: dict[str, tuple[LoadRequest, ModelInfo]] = {}  # loaded by the user and not unloaded
        self._resident: set[str] = set()          # resident in the current workers
        self._applied_loras: dict[str, Optional[LoraList]] = {}  # in the current workers; None: unknown (failed)
        self._applied_patches: dict[str, Optional[PatchSet]] = {}  # ComfyUI weight patches there, per model
        self._kept_patches: dict[str, KeptSets] = {}  # the digests each model's workers keep (sent once)
        self._listeners: list[Listener] = []
        self._steps = steps
        self.last_step: Optional[dict] = None
        self.last_error: Optional[dict] = None  # the last failed request or fault: {"text", "kind", "time"}
        self.restarts = 0
        self.stats = {"calls": 0, "last_call_s": None, "last_worker_s": None, "last_bytes_copied": 0,
                      "last_conditioning_bytes_copied": 0, "last_copied": {}, "bytes_copied_total": 0}
        self._ranks = [{"calls": 0, "last_call_s": None, "memory": {}, "weights": {}} for _ in self.config.devices]
        self._names = claim_names(self._token)  # first: its owner file proves the later names this pool's
        try:
            self._control = ControlBlock.create(self._token, self.config.world_size)
        except BaseException:
            _release_names(self._names)
            raise
        try:
            self._join = join_point(self.config, listen, token_file)
        except BaseException:
            self._control.release()
            _release_names(self._names)
            raise
        self._run = RunFolder(self._token)
        self._inputs = InputArena(self._token, self._run.ensure)  # a file in the run folder if /dev/shm is full
        self._outputs = OutputArena(self._token, self._run.ensure)
        self._exchange = Exchange(self.config.devices, self._control, self.timeouts, self._break, self._emit,
                                  lambda: self._state == "closed")
        # Runs once: from close(), when the pool is garbage-collected, or at interpreter exit.
        self._finalizer = weakref.finalize(self, _release, self._owner_pid, self._workers,
                                           tuple(part for part in (self._join, self._inputs, self._outputs,
                                                                   self._control) if part is not None),
                                           self._run, self._names)
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
    def join_address(self) -> Optional[str]:
        """HOST:PORT that joined machines connect to (None: every device is on this machine)."""
        return self._join.address if self._join is not None else None

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
                   progress: Optional[ProgressFn] = None, *, should_cancel: Optional[Callable[[], bool]] = None,
                   **options: Any) -> ModelHandle:
        """Load a checkpoint in every worker (cached there by path, dtype and options) and return its handle.

        A model that is resident already costs no header read and no request to the workers (the pool owner asks
        for its model at every step); its file's stamp is checked, so a file replaced on disk is loaded again.
        should_cancel() true (or unload / close in another thread) stops the load at the workers' next tensor:
        Cancelled, and nothing stays loaded."""
        with self._lock:
            self._ensure_running()
            request = self._resident_request(path, dtype, options) or _load_request(path, dtype, options)
            info = self._make_resident(request, progress, should_cancel)
        return ModelHandle(self, request, info)

    def set_loras(self, handle: ModelHandle, loras: Sequence, progress: Optional[ProgressFn] = None,
                  patches: Optional[PatchSet] = None, should_cancel: Optional[Callable[[], bool]] = None) -> dict:
        """Apply LoRAs [[path, strength], ...] to a loaded model in every worker, replacing its previous list, and
        then `patches` (ComfyUI's weight patches, e.g. from its stock LoRA nodes), replacing the previous set.

        Afterwards the weights are base + sum of strength x delta (in list order); [] or strength 0 give the base
        weights back exactly. The workers read the files; only the parameters whose LoRAs change are rewritten.
        The handle remembers the list: calls through it re-apply it after an unload or a pool restart, and
        switch the workers' copy back to it when another handle of the same model changed it.
        Returns rank 0's summary: {"parameters": patched now, "updated": rewritten by this call, "skipped": [...]};
        the list the workers already hold sends nothing and returns {"parameters": None, "updated": 0, ...}.
        should_cancel() true (or unload / close in another thread) stops the change at the workers' next weight:
        Cancelled, and the weights and the handle's list stay as they were.
        """
        wanted = normalize_loras(loras)
        with self._lock:
            self._ensure_running()
            self._follow_file(handle)
            self._make_resident(handle.request, None, should_cancel)
            if self._holds(handle.key, wanted, patches):
                summary = {"parameters": None, "updated": 0, "skipped": []}
            else:
                summary = self._apply_loras(handle, wanted, progress, patches, should_cancel)
        handle.loras, handle.patches = wanted, patches
        return summary

    def unload(self, model: Union[ModelHandle, str]) -> None:
        """Free a model in the workers now (a later call through a handle to it loads it again)."""
        key = model.key if isinstance(model, ModelHandle) else model
        with self._interrupting(LOADS):
            self._models.pop(key, None)
            if key in self._resident and self._state == "idle":
                self._request({"op": "unload", "key": key})
            self._resident.discard(key)
            self._forget_loras(key)
        self._emit({"event": "unloaded", "model": key})

    def unload_all(self) -> int:
        """Free every model in the workers (the pool stays up); returns how many models the pool had. A load or
        LoRA change in another thread is stopped (Cancelled there) rather than waited for."""
        with self._interrupting(LOADS):
            count = len(self._models)
            if self._state == "idle":  # also when nothing is resident: ranks may hold a load that was interrupted
                self._request({"op": "unload", "all": True})
            self._models.clear()
            self._resident.clear()
            self._forget_loras()
        self._emit({"event": "unloaded", "model": None})
        return count

    def is_loaded(self, model: Union[ModelHandle, str]) -> bool:
        return (model.key if isinstance(model, ModelHandle) else model) in self._resident

    def run(self, handle: ModelHandle, x: torch.Tensor, timestep: torch.Tensor, kwargs: dict,
            should_cancel: Optional[Callable[[], bool]] = None) -> torch.Tensor:
        """One forward of a loaded model (use the handle: it validates the arguments first)."""
        with self._lock:
            self._ensure_running()
            self._follow_file(handle)
            self._make_resident(handle.request, None, should_cancel)
            kwargs = self._controlnets_resident(kwargs, should_cancel)
            if not self._holds(handle.key, handle.loras, handle.patches):
                self._apply_loras(handle, handle.loras, None, handle.patches, should_cancel)
            if should_cancel is not None and should_cancel():
                raise Cancelled("cancelled before the call was sent to the workers")
            return self._call(handle, x, timestep, kwargs, should_cancel)

    def _controlnets_resident(self, kwargs: dict, should_cancel) -> dict:
        """The input controlnets ([{"model": ControlNet handle, "hint", "strength"}, ...]) loaded here, each sent as
        its model key (the workers run them on the call's own token shards: sp.control)."""
        entries = kwargs.get("controlnets")
        if not entries:
            return kwargs
        sent = []
        for entry in entries:
            net = entry.get("model") if isinstance(entry, dict) else None
            if not isinstance(net, ModelHandle) or net.pool is not self:
                raise ValueError("controlnets must be [{'model': ControlNet handle loaded in this pool, 'hint': "
                                 "latent, 'strength': number}, ...]")
            self._follow_file(net)
            self._make_resident(net.request, None, should_cancel)
            sent.append({"model": net.key, "hint": entry["hint"], "strength": float(entry.get("strength", 1.0))})
        return {**kwargs, "controlnets": sent}

    def status(self) -> dict:
        """JSON-ready snapshot: layout, state, per-rank device / machine / pid / memory / models / calls, the machines
        the ranks run on (name, host, joined, ranks) and call stats."""
        workers = list(self._workers)
        resident = [self._models[key] for key in sorted(self._resident) if key in self._models]
        weights = sum(info.weight_bytes for _, info in resident)
        ranks = []
        for rank, device in enumerate(self.config.devices):
            worker = workers[rank] if rank < len(workers) else None
            alive = worker is not None and worker.alive()
            here = not machine_of(device)
            memory = rank_memory(device, worker.pid if alive and here else None, self._ranks[rank]["memory"])
            if alive and weights:  # the rank's own figure (sharded blocks count as its shards), else the model's
                memory["weights"] = self._ranks[rank]["weights"].get("resident", weights)
            ranks.append({"rank": rank, "device": device, "machine": machine_of(device) or "here",
                          "pid": worker.pid if worker else None, "alive": alive,
                          "exit_cause": None if alive or worker is None else worker.exit_cause(),
                          "coords": {**dict(zip(("cfg", "ring", "ulysses"), self.config.coords(rank))),
                                     "tp": self.config.tp_index(rank)},
                          "memory": memory,
                          "models": [_model_summary(*entry) for entry in resident if alive],
                          "weights": self._ranks[rank]["weights"] if alive else {},
                          "calls": self._ranks[rank]["calls"],
                          "last_call_s": self._ranks[rank]["last_call_s"],
                          "blocks_done": self._control.counter(rank) if self._control and alive else None})
        return {"state": self._state, "activity": self.activity, "config": self.config.to_dict(),
                "layout": self.config.layout_name, "backend": self.config.backend,
                "world_size": self.config.world_size, "restarts": self.restarts, "log_dir": self._run.path,
                "last_error": self.last_error,
                "models": [_model_entry(request, info, key in self._resident, self._applied_loras.get(key),
                                        self._applied_patches.get(key))
                           for key, (request, info) in self._models.items()],
                "shared_memory": self.segment_names(), "last_step": self.last_step, "ranks": ranks,
                "machines": machine_summary(list(self.config.devices), self._join), **self.stats}

    @property
    def activity(self) -> str:
        """What the pool does now: its state, or while busy the request (loading, sampling, applying LoRAs ...)."""
        return self._activity if self._state == "busy" and self._activity else self._state

    def segment_names(self) -> list[str]:
        """Names of this pool's shared-memory segments (control, input and output arenas)."""
        if self._state == "closed":
            return []
        parts = (self._control, self._inputs, self._outputs)
        return [part.segment.name for part in parts if part.segment is not None]

    def close(self) -> None:
        """End and reap every worker and unlink every shared-memory segment. Idempotent."""
        if self._owner_pid != os.getpid():
            return  # a forked child: the workers, segments and folder are its parent's
        # A request in another thread is stopped (at the workers' next block or tensor); one stuck there must not
        # block shutdown (e.g. at interpreter exit): after CLOSE_WAIT_S go on without the lock.
        self._interrupted = frozenset(ACTIVITY)
        locked = self._lock.acquire(timeout=CLOSE_WAIT_S)
        try:
            if self._state == "closed":
                return
            self._set_state("closed")
            self._close_rendezvous()
            if not locked:  # a request still runs in another thread: its workers will not read "exit"
                _stop(self._workers, graceful=False)
            self._finalizer()
        finally:
            if locked:
                self._lock.release()

    @contextlib.contextmanager
    def _interrupting(self, ops: frozenset):
        """Hold the pool's lock, stopping requests of these ops in other threads instead of waiting for them."""
        self._interrupted = self._interrupted | ops
        try:
            with self._lock:
                self._interrupted = frozenset()
                yield
        finally:
            if self._interrupted == ops:  # never reached the lock (interrupted itself): stop asking
                self._interrupted = frozenset()

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
        self._rendezvous = Rendezvous(run_dir)
        spec = {"config": self.config.to_dict(), "parent_pid": os.getpid(), "control": self._control.name,
                "store_path": self._rendezvous.path, "run_dir": run_dir, "timeout_s": self.start_timeout_s,
                "collective_timeout_s": self.collective_timeout_s, "threads": self._threads}
        env = worker_env({**self._join.local_env(), **(self._env or {})} if self._join else self._env)
        try:
            if self._join is not None:
                store = self._join.new_store(self.start_timeout_s)
                spec["relay_store"] = {"host": self._join.host, "port": self._join.port, "secret": store.secret}
            for rank, device in enumerate(self.config.devices):
                if not machine_of(device):
                    self._workers.append(launch_worker(rank, device, spec, env, run_dir))
            if self._join is not None:
                deadline = time.monotonic() + self.start_timeout_s
                self._workers.extend(self._join.start_workers(self.config, spec, self._control, deadline))
                self._workers.sort(key=lambda worker: worker.rank)
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
                    f"(raise start_timeout_s if the machine is slow)\n" + tail_of(late[0], inline=True),
                    late[0].rank, late[0].device)

    def _start_error(self, worker: WorkerProcess, cause: str, remote_traceback: str = "") -> PoolStartError:
        # inline: a pool that cannot start is closed, and its log folder with it
        detail = remote_traceback if remote_traceback else tail_of(worker, inline=True)
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
                cause = worker.exit_cause()
                self.last_error = {"text": f"worker rank {worker.rank} on {worker.device} {cause}",
                                   "kind": "WorkerDied", "time": time.time()}
                self._emit({"event": "worker_died", "rank": worker.rank, "device": worker.device, "cause": cause})
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
        _stop(self._workers, graceful)
        self._close_rendezvous()
        self._resident.clear()
        self._forget_loras()

    def _close_rendezvous(self) -> None:
        if self._rendezvous is not None:
            self._rendezvous.close()
            self._rendezvous = None

    # ---- requests -------------------------------------------------------------------------------------------
    def _resident_request(self, path, dtype, options: dict) -> Optional[LoadRequest]:
        """The request a resident model was loaded with, found without reading its header: a resident model of
        the same file with the same stamp (the file is unchanged) lends it."""
        path = _resolved(path)
        try:
            stamp = checkpoint_stamp(path)
        except (OSError, ValueError):  # _load_request says what is wrong
            return None
        same_file = next((self._models[key][0] for key in self._resident
                          if self._models[key][0].path == path and self._models[key][0].stamp == stamp), None)
        if same_file is None:
            return None
        key = _request_for(path, dtype, options, same_file.header, stamp, same_file.detection).key
        return self._models[key][0] if key in self._resident else None

    def _make_resident(self, request: LoadRequest, progress: Optional[ProgressFn],
                       should_cancel: Optional[Callable[[], bool]] = None) -> ModelInfo:
        if request.key not in self._resident:
            message = {"op": "load", "request": request.to_message(), "shared_weights": self._shared_weights_name()}
            try:
                replies = self._request(message, should_cancel, on_progress=self._progress_relay(request, progress))
            except (Cancelled, RemoteError):  # ranks that loaded it hold a model the pool does not know
                self._drop_partial_load(request.key)
                raise
            finally:
                if message["shared_weights"]:
                    remove_chunks(message["shared_weights"])
            infos = [reply["info"] for reply in replies]
            if any(info != infos[0] for info in infos):
                self._break("ranks loaded different models")
                raise WorkerError(f"the ranks disagree about {request.path}: {infos}")
            self._drop_superseded(request)
            self._models[request.key] = (request, ModelInfo(**infos[0]))
            self._resident.add(request.key)
            self._applied_loras[request.key] = ()  # freshly loaded: base weights
            self._applied_patches[request.key] = None
            self._emit({"event": "loaded", "model": _model_entry(request, self._models[request.key][1], True)})
        return self._models[request.key][1]

    def _shared_weights_name(self) -> Optional[str]:
        """The chunk names' base for a load whose CPU ranks share its weights; None: each keeps its own copy."""
        if not self.share_cpu_weights or self.config.world_size < 2 or not can_share() or \
                any(not device.startswith("cpu") for device in self.config.devices):
            return None
        return fresh_name(self._token, "w")

    def _drop_partial_load(self, key: str) -> None:
        """After a cancelled or failed load: ranks that finished (before they saw the cancel, or on a machine whose
        copy of the file was accepted) hold the model; free it (not when close or an unload interrupted it: they
        free what they free, and never wait for this)."""
        if self._state != "idle" or self._interrupted:
            return
        try:
            self._request({"op": "unload", "key": key})
        except Exception:  # noqa: BLE001 - the pool says what failed; the model is unknown to the host anyway
            log.warning("freeing a partial load of %s in the workers failed", key, exc_info=True)

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

    def _holds(self, key: str, loras: LoraList, patches: Optional[PatchSet]) -> bool:
        """Whether the workers' copy of the model carries exactly these LoRAs and weight patches."""
        if key not in self._applied_patches or self._applied_loras.get(key) != loras:
            return False
        applied = self._applied_patches[key]
        return (applied.digest if applied else None) == (patches.digest if patches else None)

    def _forget_loras(self, key: Optional[str] = None) -> None:
        """The workers' LoRA state of a model (or of all) is gone or unknown."""
        for table in (self._applied_loras, self._applied_patches, self._kept_patches):
            if key is None:
                table.clear()
            else:
                table.pop(key, None)

    def _apply_loras(self, handle: ModelHandle, loras: LoraList, progress: Optional[ProgressFn],
                     patches: Optional[PatchSet] = None, should_cancel: Optional[Callable[[], bool]] = None) -> dict:
        key = handle.key
        self._applied_loras[key] = None  # a failure part-way leaves the workers' state unknown until it succeeds
        self._applied_patches.pop(key, None)
        kept = self._kept_patches.setdefault(key, KeptSets())
        message = {"op": "set_loras", "key": key, "loras": [list(lora) for lora in loras], "patches": None}
        segment = None
        try:
            if patches is not None and patches.digest in kept:
                message["patches"] = {"digest": patches.digest}
            elif patches is not None:
                message["patches"], segment = stage_patch_set(patches, self._token, self._run.ensure)
            replies = self._request(message, should_cancel, on_progress=_quiet(progress))
        except BaseException:
            self._kept_patches.pop(key, None)
            raise
        finally:
            if segment is not None:
                segment.release()
        if patches is not None:
            kept.use(patches.digest)
        self._applied_loras[key], self._applied_patches[key] = loras, patches
        summary = replies[0]
        if summary.get("skipped"):
            log.warning("LoRA modules for the text encoder were skipped (the diffusion model has no such weights): "
                        "%s", summary["skipped"][:8])
        self._emit({"event": "loras", "model": handle.path, "loras": [list(lora) for lora in loras],
                    "patches": patches.summary() if patches else None, "updated": summary.get("updated")})
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
        message, copied = call_message(handle, x, timestep, kwargs, self._inputs, self._outputs)
        self._control.reset_counters(self.config.world_size)
        replies = self._request(message, should_cancel=should_cancel)
        out = self._outputs.read(message["output"], x.dtype)
        self._record_call(time.perf_counter() - started, copied, replies, handle, tuple(x.shape))
        return out

    def _record_call(self, seconds: float, copied: dict, replies: list[dict], handle: ModelHandle,
                     shape: tuple) -> None:
        conditioning = sum(n for name, n in copied.items() if name not in ("x", "timestep"))
        worker_s = max(reply.get("seconds", 0.0) for reply in replies)
        self.stats.update(calls=self.stats["calls"] + 1, last_call_s=seconds, last_worker_s=worker_s,
                          last_copied=dict(copied),
                          last_bytes_copied=sum(copied.values()), last_conditioning_bytes_copied=conditioning,
                          bytes_copied_total=self.stats["bytes_copied_total"] + sum(copied.values()))
        for rank, reply in enumerate(replies):
            self._ranks[rank]["calls"] += 1
            self._ranks[rank]["last_call_s"] = reply.get("seconds")
        layout = self.config.layout_name
        self._steps.record(handle.key, shape, layout, seconds)
        self.last_step = {"model": handle.path, "shape": list(shape), "layout": layout,
                          "world_size": self.config.world_size, "seconds": seconds,
                          "rank_seconds": [reply.get("seconds") for reply in replies],
                          "baseline_s": self._steps.single_device(handle.key, shape),
                          "speedup": self._steps.speedup(handle.key, shape, layout)}
        self._emit({"event": "call", **self.last_step, "worker_seconds": worker_s,
                    "bytes_copied": sum(copied.values()), "conditioning_bytes_copied": conditioning})

    def _request(self, message: dict, should_cancel: Optional[Callable[[], bool]] = None,
                 on_progress: Optional[ProgressFn] = None) -> list[dict]:
        """One request to every worker (see requests.Exchange); the pool is busy meanwhile. It is cancelled when
        should_cancel() is true, or when unload / close in another thread interrupts requests of its op."""
        op = message["op"]

        def cancel() -> bool:
            return op in self._interrupted or (should_cancel is not None and should_cancel())
        self._set_state("busy", ACTIVITY.get(op, op))
        try:
            replies = self._exchange.request(self._workers, message, cancel, on_progress)
        except Exception as error:
            self._note_error(error)
            raise
        finally:
            if self._state == "busy":  # failures that did not break the pool leave it usable
                self._set_state("idle")
        for rank, reply in enumerate(replies):
            if reply.get("memory"):
                self._ranks[rank]["memory"] = reply["memory"]
            if "weights" in reply:
                self._ranks[rank]["weights"] = reply["weights"]
        return replies

    def _note_error(self, error: BaseException) -> None:
        """Keep the failure for status() (the panel shows it with what to do); cancellations are not failures."""
        if not isinstance(error, Cancelled):
            self.last_error = {"text": str(error), "kind": type(error).__name__, "time": time.time()}

    # ---- events ---------------------------------------------------------------------------------------------
    def _set_state(self, state: str, activity: Optional[str] = None) -> None:
        if (state, activity) != (self._state, self._activity) and self._state != "closed":  # closed is final
            self._state, self._activity = state, activity
            self._emit({"event": "state", "state": state, "activity": self.activity})

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


def check_machine_layout(config: SPConfig, ulysses_across_machines: bool) -> None:
    """Ulysses groups stay inside one machine (their all-to-alls move activations every block); Ring and CFG span
    machines. A layout that sends Ulysses over the network is refused unless forced, then warned about."""
    crossing = config.ulysses_groups_across_machines()
    if not crossing:
        return
    text = (f"layout {config.layout_name} puts Ulysses groups {crossing[:4]} across machines: every block's "
            f"all-to-alls would cross the network (per step about 4 x activations x (U-1)/U per rank; `python -m "
            f"sp_runtime doctor --link HOST:PORT` estimates the time)")
    if not ulysses_across_machines:
        raise ValueError(text + "; keep each Ulysses group on one machine (raise ring_degree or cfg so Ring / CFG "
                                "span the machines), or pass ulysses_across_machines=True to force it")
    log.warning(text)


def join_point(config: SPConfig, listen: Optional[str], token_file: Optional[str]):
    """The join listener of a pool with devices on other machines (None otherwise). Unset, listen and token_file
    come from ULYSSES_SP_LISTEN and ULYSSES_SP_TOKEN_FILE (how ComfyUI's loader nodes get them)."""
    if all(not machine for machine in config.machines):
        return None
    listen = listen or os.environ.get("ULYSSES_SP_LISTEN")
    token_file = token_file or os.environ.get("ULYSSES_SP_TOKEN_FILE")
    if not token_file:
        raise ValueError(f"devices {list(config.devices)} include other machines: give token_file (a shared secret, "
                         f"chmod 600; under ComfyUI the environment variable ULYSSES_SP_TOKEN_FILE) for them to "
                         f"join with")
    from .remote import JoinPoint
    expected = {machine: [local_device(d) for d in config.devices if machine_of(d) == machine]
                for machine in config.machines if machine}
    return JoinPoint(listen or "127.0.0.1:0", token_file, expected)


def _load_request(path, dtype, options: dict) -> LoadRequest:
    """The request with the checkpoint's header, read once here: a file that is not a checkpoint of a known family
    fails now, before any worker reads it, and the workers do not read the header again."""
    path = _resolved(path)
    stamp = checkpoint_stamp(path)  # before the header: a file replaced in between is refused by the workers
    return _request_for(path, dtype, options, read_checkpoint_header(path), stamp)


def _request_for(path: str, dtype, options: dict, header, stamp: list, detection=None) -> LoadRequest:
    """The request of one model. Its key is the model's identity: the resolved path (one model through any
    symlink), the dtype "default" stands for, the options, and the files' stamp (a file replaced on disk is another
    model). It carries the header and its detection (made here unless given): nobody detects the file again."""
    from ..checkpoints.loading import resolved_dtype_name
    from ..detection import detect
    from ..formats.kernels import mode
    from ..sharding import shard_option
    detection = detection or detect(header)
    shard_option(options)  # a bad value fails here, before any worker loads
    mode(options.get("quant_kernels"))
    try:
        json.dumps(options)
    except TypeError as error:
        raise ValueError(f"load options must be JSON values (numbers, strings, lists, dicts): {error}") from None
    return LoadRequest(path, resolved_dtype_name(dtype, header, detection), dict(options), header, stamp, detection)


def _resolved(path) -> str:
    return os.path.realpath(os.path.expanduser(os.fspath(path)))


def _model_entry(request: LoadRequest, info: ModelInfo, resident: bool, loras: Optional[LoraList] = (),
                 patches: Optional[PatchSet] = None) -> dict:
    """A model in status(): its file, options, LoRA files and ComfyUI weight patches (labels with strengths)."""
    return {"key": request.key, "path": request.path, "dtype": request.dtype, "options": request.options,
            "resident": resident, "loras": [list(lora) for lora in loras or ()],
            "weight_patches": patches.summary() if patches else None, **info.to_dict()}


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


def _stop(workers: list[WorkerProcess], graceful: bool) -> None:
    """End and reap the workers (asked to exit, or killed); empties the list."""
    stopping = list(workers)
    workers.clear()
    for worker in stopping:
        if graceful and worker.alive():
            try:
                send(worker.conn, {"op": "exit", "id": 0})
            except OSError:
                pass
        else:
            worker.kill()
    deadline = time.monotonic() + (5.0 if graceful else 0.0)
    for worker in stopping:
        worker.reap(wait_s=max(0.0, deadline - time.monotonic()) if graceful else 5.0)


def _release(owner_pid: int, workers: list[WorkerProcess], parts: tuple, run: RunFolder,
             names: Optional[OwnerLock]) -> None:
    """The pool's finalizer: holds no reference to the pool, so it also runs when the pool is garbage-collected.
    A forked child inherits it: there it does nothing, the workers, segments and folder are the parent's."""
    if os.getpid() != owner_pid:
        return
    _stop(workers, graceful=True)
    for part in parts:
        part.release()
    release_retired()
    run.remove()
    _release_names(names)


def _release_names(names: Optional[OwnerLock]) -> None:
    """Drop the owner file of the pool's segments (after them: it proves them the pool's)."""
    if names is not None:
        names.release()


def _forget_pools_in_child() -> None:
    for pool in list(_live_pools):
        pool._after_fork_in_child()


os.register_at_fork(after_in_child=_forget_pools_in_child)
