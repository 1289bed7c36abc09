"""Worker process main: one per device, started by WorkerPool as `python -m sp_runtime.pool.worker <pipe fd>`; the
spec (JSON: layout, control segment, store, run folder) is the pipe's first message, never in argv (world-readable).

It joins the process group, then serves JSON requests from its pipe (load, call, set_loras, unload, exit) until told
to exit
or until the pipe closes (the parent died). Tensors come and go through shared memory only.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import os
import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Optional

import torch
import torch.distributed as dist

from ..cfg_parallel import run_forward
from ..checkpoints.header import check_unchanged
from ..config import SPConfig
from ..contract import Cancelled, LoadRequest
from ..devices import local_device
from ..groups import build_groups
from .context import DeviceCache, WorkerCallContext, view_key
from .control import ControlBlock
from .errors import CPU_OUT_OF_MEMORY
from .loading import load_worker_model
from .orphan import guard
from .patch_transport import KeptSets, read_patch_set
from .protocol import decode_tree, name_to_dtype, recv, send
from .segments import Segment, release_retired

PROGRESS_INTERVAL_S = 0.1
# Test hook (set in a pool's env by the tests only): "op=seconds,...": every progress step of these requests (load,
# set_loras) sleeps that long, a slow load.
TEST_SLOW_PROGRESS = {op: float(seconds) for op, _, seconds in (
    entry.partition("=") for entry in os.environ.get("ULYSSES_SP_TEST_SLOW_PROGRESS", "").split(",") if entry)}
NCCL_REMEDIES = ("usual remedies: set NCCL_P2P_DISABLE=1 (GPUs without working peer-to-peer, e.g. some consumer "
                 "cards or virtual machines), NCCL_IB_DISABLE=1 (no InfiniBand), use the same NVIDIA driver for all "
                 "GPUs, and set NCCL_DEBUG=INFO to see why")


def error_reply(error: BaseException) -> dict:
    frames = [frame for frame in traceback.extract_tb(error.__traceback__)
              if os.path.abspath(frame.filename) != os.path.abspath(__file__)][-8:]  # the family's frames matter
    summary = "".join(traceback.format_list(frames)) + f"{type(error).__name__}: {error}"
    return {"ok": False, "error": type(error).__name__, "message": str(error), "traceback": summary[-6000:],
            "oom": out_of_memory(error)}


def out_of_memory(error: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or a failed CPU allocation (torch raises a plain RuntimeError there)."""
    return isinstance(error, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(error, RuntimeError) and CPU_OUT_OF_MEMORY in str(error))


class StartError(Exception):
    """A start-up step failed; the message says which and what to do."""


class Worker:
    def __init__(self, spec: dict, conn: Connection):
        self.spec = spec
        self.conn = conn
        self.rank = spec["rank"]
        self.config = SPConfig(**spec["config"])
        self.device = torch.device(local_device(self.config.devices[self.rank]))
        self.groups = None
        self.control = ControlBlock.attach(spec["control"])
        self.segments: dict[str, Segment] = {}
        self.models: dict = {}
        self.requests: dict[str, LoadRequest] = {}
        self.lora_states: dict = {}  # model key -> sp_runtime.lora.apply.LoraState, once a LoRA was set
        self.patch_sets: dict[str, KeptSets] = {}  # model key -> ComfyUI weight patch sets received for it
        self.cache = DeviceCache()
        self.calls = 0

    # ---- start-up -------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.control.keep_beating(self.rank)  # the host's liveness watchdog reads it during every request
        self._setup_device()
        self._join_process_group()
        self.groups = build_groups(self.config)

    def _setup_device(self) -> None:
        if self.device.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if self.device.index >= count:
                visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
                raise StartError(f"CUDA device {self.device} is not available: this process sees {count} CUDA "
                                 f"device(s) (torch {torch.__version__}, CUDA_VISIBLE_DEVICES={visible}); pick "
                                 f"devices from cuda:0 to cuda:{count - 1}" if count else
                                 f"CUDA device {self.device} is not available: torch {torch.__version__} sees no "
                                 f"CUDA device (CPU-only torch build, no driver, or CUDA_VISIBLE_DEVICES={visible})")
            try:
                torch.cuda.set_device(self.device)
                torch.empty(1, device=self.device)  # create the CUDA context now, so a broken GPU fails at start
            except torch.OutOfMemoryError:
                raise
            except Exception as error:
                raise StartError(f"CUDA device {self.device} could not be initialised: {type(error).__name__}: "
                                 f"{error}; check `nvidia-smi`, the driver, and that the GPU is not in exclusive "
                                 f"mode for another process") from error
        else:
            threads = self.spec.get("threads") or max(1, (os.cpu_count() or 1) // self.config.world_size)
            torch.set_num_threads(threads)

    def _join_process_group(self) -> None:
        timeout = datetime.timedelta(seconds=self.spec["timeout_s"])
        try:
            store = self._store(timeout)
            options = dict(backend=self.config.backend, store=store, rank=self.rank,
                           world_size=self.config.world_size,
                           timeout=datetime.timedelta(seconds=self.spec["collective_timeout_s"]))
            if self.device.type == "cuda":
                options["device_id"] = self.device  # NCCL communicators are created now: failures show at start
            dist.init_process_group(**options)
        except torch.OutOfMemoryError:
            raise
        except Exception as error:
            hint = NCCL_REMEDIES if self.config.backend == "nccl" else \
                "another worker may have failed to start (see its error), or a firewall blocks 127.0.0.1"
            raise StartError(f"{self.config.backend} process group init failed on {self.device} (rank {self.rank} "
                             f"of {self.config.world_size}): {type(error).__name__}: {error}; {hint}") from error

    def _store(self, timeout: datetime.timedelta):
        """The rendezvous store: a file in the run folder, or the host's store over its join listener (a pool
        that spans machines)."""
        relay = self.spec.get("relay_store")
        if relay:
            from .relay_store import RelayStore
            # kept here: the process group holds only the C++ side, and a freed Python store has no methods left
            self.relay_store = RelayStore(relay["host"], relay["port"], relay["secret"], timeout.total_seconds())
            return self.relay_store
        store = dist.FileStore(self.spec["store_path"], self.config.world_size)
        store.set_timeout(timeout)
        return store

    # ---- serving --------------------------------------------------------------------------------------------
    def serve(self) -> None:
        while True:
            try:
                message = recv(self.conn)
            except (EOFError, OSError):
                return  # the pool closed our pipe or died
            if message["op"] == "exit":
                send(self.conn, {"id": message.get("id"), "ok": True})
                return
            reply = self._handle(message)
            reply["id"] = message.get("id")
            reply["memory"] = self.memory()
            reply["weights"] = self.weight_accounting()
            send(self.conn, reply)

    def _handle(self, message: dict) -> dict:
        try:
            return {"ok": True, **getattr(self, "op_" + message["op"])(message)}
        except BaseException as error:  # noqa: BLE001 - every failure goes back to the caller
            reply = error_reply(error)
            if isinstance(error, torch.OutOfMemoryError) and self.device.type == "cuda":
                torch.cuda.empty_cache()
            return reply

    def memory(self) -> dict:
        if self.device.type != "cuda":
            return {}
        return {"allocated": torch.cuda.memory_allocated(self.device),
                "reserved": torch.cuda.memory_reserved(self.device),
                "peak": torch.cuda.max_memory_allocated(self.device),
                "total": torch.cuda.mem_get_info(self.device)[1]}

    def weight_accounting(self) -> dict:
        """Over the loaded models: bytes of weights this rank holds (sharded blocks count as their shards); of the
        sharded blocks their whole size, the largest one, the most bytes gathered at once and gathered from other
        ranks since load."""
        from ..sharding import model_shards
        shards = [s for s in (model_shards(getattr(m, "model", None)) for m in self.models.values()) if s]
        return {"resident": sum(model.info.weight_bytes for model in self.models.values()),
                "sharded_blocks": sum(s.full_bytes for s in shards),
                "largest_block": max((s.largest_block for s in shards), default=0),
                "gathered_peak": max((s.gathered_peak for s in shards), default=0),
                "bytes_moved": sum(s.bytes_moved for s in shards)}

    def op_load(self, message: dict) -> dict:
        request = LoadRequest.from_message(message["request"])
        key = message.get("as_key") or request.key  # a joined machine keeps its own copy under the host's key
        if key not in self.models:
            check_unchanged(request.path, request.stamp)
            if not self.models:
                self._freeze_long_lived()
            with self._weights_sharing(message.get("shared_weights")):
                self.models[key] = load_worker_model(request, self.device, self.groups,
                                                     self._progress_fn(message["id"], "load"))
            self.requests[key] = request
        return {"info": self.models[key].info.to_dict()}

    @staticmethod
    def _freeze_long_lived() -> None:
        """Takes what outlives every model (torch's, diffusers' and our modules: ~400k objects) out of the cyclic
        collector's reach, so an unload's gc.collect() scans only what was made since: milliseconds instead of
        ~0.3 s of CPU per rank. Done while no model is loaded and after a collection, so nothing frozen is a
        model's or garbage: an unloaded model's reference cycles are still found."""
        gc.collect()
        gc.freeze()

    def _weights_sharing(self, base: Optional[str]):
        """CPU ranks keep the weights they load in shared chunks named from `base` (see shared_weights)."""
        if base is None or self.device.type != "cpu":
            return contextlib.nullcontext()
        from ..formats import copies_into
        from .shared_weights import SharedWeights
        return copies_into(SharedWeights(base))

    def _progress_fn(self, request_id, op: str):
        last = [0.0]

        def progress(fraction: float, text: str = "") -> None:
            """Relays rank 0's progress; on every rank, the point where a load or LoRA change can be cancelled."""
            if op in TEST_SLOW_PROGRESS:
                time.sleep(TEST_SLOW_PROGRESS[op])
            if self.control.cancel_requested():
                raise Cancelled(f"cancelled by the caller at {text or 'a progress step'}")
            now = time.monotonic()
            if self.rank == 0 and (now - last[0] >= PROGRESS_INTERVAL_S or fraction >= 1.0):
                last[0] = now
                send(self.conn, {"id": request_id, "progress": float(fraction), "message": str(text)})
        return progress

    def op_unload(self, message: dict) -> dict:
        keys = list(self.models) if message.get("all") else [message["key"]]
        for key in keys:
            self.models.pop(key, None)
            self.requests.pop(key, None)
            self.lora_states.pop(key, None)
            self.patch_sets.pop(key, None)
        self.cache.clear()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return {"models": list(self.models)}

    def op_set_loras(self, message: dict) -> dict:
        """Make a loaded model's weights base + the LoRAs [[path, strength], ...] + a ComfyUI weight patch set
        (message["patches"]: None, or its digest, with the set itself when this worker does not keep it yet);
        no LoRAs and no patches restore the base weights."""
        key = message["key"]
        if key not in self.models:
            raise KeyError(f"model {key} is not loaded in worker rank {self.rank}")
        check_unchanged(self.requests[key].path, self.requests[key].stamp)  # LoRAs re-read the base weights
        if key not in self.lora_states and not message["loras"] and message.get("patches") is None:
            # nothing was ever applied: the weights are the base (also for a family without LoRA support, whose
            # refused LoRA must not leave every later call failing on this restore)
            return {"parameters": 0, "updated": 0, "skipped": []}
        if key not in self.lora_states:
            from ..lora.apply import lora_state
            request = self.requests[key]
            self.lora_states[key] = lora_state(self.models[key], request.header or request.path, self.device,
                                               request.detection)
        patches = self._patch_set(key, message.get("patches"))
        return self.lora_states[key].set(message["loras"], self._progress_fn(message["id"], "set_loras"), patches)

    def _patch_set(self, key: str, entry: Optional[dict]):
        if entry is None:
            return None
        kept = self.patch_sets.setdefault(key, KeptSets())
        if "set" in entry:
            return kept.use(entry["digest"], read_patch_set(entry))
        if entry["digest"] not in kept:
            raise KeyError(f"weight patch set {entry['digest']} is not kept in worker rank {self.rank}")
        return kept.use(entry["digest"])

    def op_call(self, message: dict) -> dict:
        model = self.models.get(message["key"])
        if model is None:
            raise KeyError(f"model {message['key']} is not loaded in worker rank {self.rank}")
        started = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        x, timestep, kwargs, out, versions = self._arguments(message)
        ctx = WorkerCallContext(self.device, self.groups, self.control, self.cache, versions)
        with torch.inference_mode():
            run_forward(model, x, timestep, kwargs, out, ctx)  # splits CFG batches over the CFG groups
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the host reads `out` as soon as we reply
        del x, timestep, kwargs, out
        self.calls += 1
        return {"seconds": time.perf_counter() - started, "cancel_checks": ctx.cancel_checks}

    def _arguments(self, message: dict):
        inputs = self._segment(message["input_segment"])
        region = message["output"]
        output = self._segment(region["segment"])
        self._release_other_segments({inputs.name, output.name})
        self.cache.keep_only(set(message["live"]))
        tensors, versions = {}, {}
        for spec in message["tensors"]:
            view = inputs.view(spec["offset"], name_to_dtype(spec["dtype"]), tuple(spec["shape"]))
            tensors[spec["name"]] = view
            versions[view_key(view)] = spec["version"]
        args = {name: decode_tree(node, tensors.__getitem__) for name, node in message["args"].items()}
        out = output.view(region["offset"], name_to_dtype(region["dtype"]), tuple(region["shape"]))
        return args.pop("x"), args.pop("timestep"), self._with_controlnets(args.pop("kwargs")), out, versions

    def _with_controlnets(self, kwargs: dict) -> dict:
        """The input controlnets' model keys as the loaded ControlNet workers."""
        entries = kwargs.get("controlnets")
        if not entries:
            return kwargs
        for entry in entries:
            if entry["model"] not in self.models:
                raise KeyError(f"ControlNet {entry['model']} is not loaded in worker rank {self.rank}")
        return {**kwargs, "controlnets": [{**entry, "model": self.models[entry["model"]]} for entry in entries]}

    def _segment(self, name: str) -> Segment:
        if name not in self.segments:
            self.segments[name] = Segment.attach(name)
        return self.segments[name]

    def _release_other_segments(self, keep: set[str]) -> None:
        for name in [name for name in self.segments if name not in keep]:
            self.segments.pop(name).release()
        release_retired()

    def shutdown(self) -> None:
        self.lora_states.clear()
        self.patch_sets.clear()
        self.models.clear()
        self.cache.clear()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass


def main(argv: list[str]) -> int:
    conn = Connection(int(argv[1]))
    try:
        spec = recv(conn)
    except (EOFError, OSError):
        return 3  # the host died before it sent the spec
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C belongs to the host, which decides what to stop
    guard(spec["parent_pid"], spec["control"], spec["run_dir"])
    try:
        worker = Worker(spec, conn)
        worker.start()
    except BaseException as error:  # noqa: BLE001 - reported to the host, which raises PoolStartError
        reply = error_reply(error)
        if isinstance(error, torch.OutOfMemoryError):
            reply["message"] = f"out of memory on {spec['config']['devices'][spec['rank']]} while starting: {error}"
        send(conn, {"event": "start_failed", **reply})
        return 1
    send(conn, {"event": "ready", "rank": worker.rank, "pid": os.getpid(), "device": str(worker.device),
                "torch": torch.__version__, "threads": torch.get_num_threads(), "memory": worker.memory()})
    try:
        worker.serve()
    finally:
        worker.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
