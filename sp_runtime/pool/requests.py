"""One request to every worker and the wait for all replies: progress relay, dead and hung ranks (a liveness
watchdog on each rank's heartbeat), wedged calls (a progress watchdog: no block passed and no CPU worker computing
for stall_s), cancel with a grace that counts from the workers' last progress, and the error texts of failed
requests.

Progress inside a call is a block passed on any rank, or, on CPU workers, CPU time spent: a slow block computes, a
rank wedged before or inside a collective (gloo waits without spinning) or asleep does not.
"""
from __future__ import annotations

import collections
import itertools
import logging
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Callable, Optional, Sequence

import torch

from ..contract import Cancelled
from ..checkpoints.loading import ProgressFn
from .arena import InputArena, OutputArena
from .control import ControlBlock
from .errors import PoolClosedError, RemoteError, WorkerError
from .identity import IdentityMismatch
from .protocol import encode_tree, recv, send
from .spawn import WorkerProcess

log = logging.getLogger("ulysses_sp.pool")
POLL_S = 0.05
CANCEL_GRACE_BLOCKS = 2.0  # after a cancel, wait this many of the slowest measured blocks (at least cancel_grace_s)
APART = frozenset({"load", "set_loras", "unload"})  # requests each rank serves without collectives
STALL_BLOCKS = 4.0  # the stall watchdog waits at least this many of the slowest measured blocks
CPU_SAMPLE_S = 0.25  # CPU time is sampled this often, and compared over the last CPU_WINDOW_S
CPU_WINDOW_S = 1.0  # (a rank that stops computing is seen idle this much later)
CPU_BUSY_SHARE = 0.02  # a rank that used this share of the window (and 2 clock ticks) computes; an idle one with its
CPU_BUSY_MIN_S = 0.02  # heartbeat thread uses ~0.0002 (and the kernel counts CPU time in ticks of 10 ms)


@dataclass
class Timeouts:
    """error_grace_s: after one rank raised, how long the others may take to answer before the pool restarts.
    cancel_grace_s: after a cancel, the least time workers may take to reach their next block check.
    watchdog_s: a rank whose heartbeat stops for this long (stopped, or stuck holding the interpreter) is hung.
    stall_s: a call in which no block passes and no CPU worker computes for this long (or STALL_BLOCKS of the
        slowest measured block, if longer) is wedged, e.g. a rank stuck before a collective the others wait in.
    """

    error_grace_s: float = 3.0
    cancel_grace_s: float = 5.0
    watchdog_s: float = 20.0
    stall_s: float = 60.0


class Exchange:
    """Sends requests to the current workers and turns every way they can fail into one clear exception.

    on_break(reason) is called when the workers cannot be trusted any more (some may hang in a collective): the
    pool kills them and restarts on the next call. on_event(event) reports faults to the pool's listeners.
    closed() tells whether the pool was closed (then a worker that ended was stopped by close(), not a crash).
    """

    def __init__(self, devices: Sequence[str], control: ControlBlock, timeouts: Timeouts,
                 on_break: Callable[[str], None], on_event: Callable[[dict], None], closed: Callable[[], bool]):
        self.devices = list(devices)
        self.control = control
        self.timeouts = timeouts
        self.on_break = on_break
        self._on_event = on_event
        self._closed = closed
        self._ids = itertools.count(1)
        self.block_s = 0.0  # the slowest block of the last call that measured one

    def request(self, workers: Sequence[WorkerProcess], message: dict,
                should_cancel: Optional[Callable[[], bool]] = None,
                on_progress: Optional[ProgressFn] = None) -> list[dict]:
        """Send one request to every worker and wait for all replies; raise on any failure."""
        message["id"] = next(self._ids)
        self.control.set_cancel(False)
        try:
            for worker in workers:
                try:
                    send(worker.conn, message)
                except OSError:
                    raise self.worker_died(worker, message["op"]) from None
            wait_ = _Wait(self, workers, message, should_cancel, on_progress)
            replies = wait_.run()
        except Cancelled:
            if self._closed():  # close() in another thread stopped the request: say so
                raise PoolClosedError(f"the worker pool was closed during {message['op']}") from None
            raise
        except WorkerError:
            raise
        except BaseException:  # e.g. KeyboardInterrupt while waiting: the workers are mid-call
            self.on_break(f"interrupted while waiting for the workers ({message['op']})")
            raise
        try:
            self._raise_failures(replies, message["op"])
        except Cancelled as cancelled:
            if wait_.callback_error is not None:  # the workers stopped cleanly: the caller gets its own error
                raise wait_.callback_error from cancelled
            raise
        if wait_.callback_error is not None:
            raise wait_.callback_error
        if wait_.cancel_at is not None:
            raise Cancelled("cancelled by the caller (the call finished before the workers saw it)")
        return replies

    def cancel_grace_s(self, block_s: float) -> float:
        return max(self.timeouts.cancel_grace_s, CANCEL_GRACE_BLOCKS * max(block_s, self.block_s))

    def stall_limit_s(self, block_s: float) -> float:
        return max(self.timeouts.stall_s, STALL_BLOCKS * max(block_s, self.block_s))

    def _raise_failures(self, replies: list[dict], op: str) -> None:
        errors = {rank: reply for rank, reply in enumerate(replies) if not reply["ok"]}
        if not errors:
            return
        # Loads and LoRA changes run apart on each rank (no collectives): some may finish before they see a cancel.
        if all(reply["error"] == "Cancelled" for reply in errors.values()) and (
                len(errors) == len(replies) or op in APART):
            raise Cancelled(next(iter(errors.values()))["message"])
        # Ranks that failed differently (or not at all) may disagree about which collectives ran: restart. Not when
        # a joined machine refused its copy of a file (before its ranks began a load or LoRA change, which have no
        # collectives): the pool frees a partial load and re-applies LoRAs itself.
        consistent = len(errors) == len(replies) and len({reply["error"] for reply in errors.values()}) == 1 or (
            op in APART and all(reply["error"] == IdentityMismatch.__name__ for reply in errors.values()))
        if not consistent:
            self.on_break(f"ranks {sorted(errors)} of {len(replies)} failed during {op}")
        raise self.remote_error(errors, op, restarted=not consistent)

    def remote_error(self, replies: dict[int, dict], op: str, restarted: bool) -> RemoteError:
        rank, reply = next((rank, reply) for rank, reply in sorted(replies.items()) if not reply["ok"])
        device = self.devices[rank]
        text = f"worker rank {rank} on {device} failed during {op}: {reply['error']}: {reply['message']}"
        if reply.get("oom"):
            text += (f"\nout of memory on {device}: lower the resolution, frame count or batch, use more devices, "
                     f"or load the weights in a smaller dtype (bf16 / fp8)")
            if device == "cpu":
                text += "; free RAM or use fewer CPU workers (they share one copy of the weights, but each holds its " \
                        "own activations)"
        if restarted:
            text += "\n(the other ranks could not finish, so the pool restarts on the next call)"
        text += f"\n--- worker traceback (rank {rank}) ---\n{reply.get('traceback', '')}"
        return RemoteError(text, rank, device, reply["error"], reply["message"], reply.get("traceback", ""))

    def worker_died(self, worker: WorkerProcess, op: str) -> WorkerError:
        if self._closed():  # close() in another thread stopped it: not a crash, not the OOM killer
            return PoolClosedError(f"the worker pool was closed during {op}")
        cause = worker.exit_cause(wait_s=2.0)
        tail = tail_of(worker)
        self._on_event({"event": "worker_died", "rank": worker.rank, "device": worker.device, "cause": cause})
        self.on_break(f"rank {worker.rank} died")
        return WorkerError(f"worker rank {worker.rank} on {worker.device} (pid {worker.pid}) died during {op}: "
                           f"{cause}; the pool restarts on the next call" + (f"\n{tail}" if tail else ""),
                           worker.rank, worker.device)

    def worker_hung(self, worker: WorkerProcess, op: str, silent_s: float) -> WorkerError:
        self._on_event({"event": "worker_hung", "rank": worker.rank, "device": worker.device,
                        "silent_s": silent_s})
        self.on_break(f"rank {worker.rank} hung")
        return WorkerError(f"worker rank {worker.rank} on {worker.device} (pid {worker.pid}) made no progress for "
                           f"{silent_s:.1f} s during {op} (the process is stopped, or stuck in a driver call that "
                           f"holds the interpreter); it was killed and the pool restarts on the next call. Raise "
                           f"watchdog_s if this rank is only slow.", worker.rank, worker.device)

    def call_stalled(self, workers: Sequence[WorkerProcess], op: str, stalled_s: float) -> WorkerError:
        blocks = {worker.rank: self.control.counter(worker.rank) for worker in workers}
        self._on_event({"event": "worker_hung", "rank": None, "device": None, "silent_s": stalled_s})
        self.on_break(f"no progress for {stalled_s:.1f} s")
        first = min(workers, key=lambda worker: worker.rank)
        return WorkerError(f"the workers made no progress for {stalled_s:.1f} s during {op} (no block passed and no "
                           f"CPU worker computed; blocks passed per rank: {blocks}): a rank is wedged, e.g. stuck "
                           f"before a collective the others wait in. They were killed and the pool restarts on the "
                           f"next call. Raise stall_s if a single block of this model is that slow.",
                           first.rank, first.device)


class _Wait:
    """The wait for one request's replies (one instance per request)."""

    def __init__(self, exchange: Exchange, workers: Sequence[WorkerProcess], message: dict,
                 should_cancel: Optional[Callable[[], bool]], on_progress: Optional[ProgressFn]):
        self.exchange = exchange
        self.control = exchange.control
        self.message = message
        self.op = message["op"]
        self.should_cancel = should_cancel
        self.on_progress = on_progress
        self.pending = {worker.conn: worker for worker in workers}
        self.replies: dict[int, dict] = {}
        now = time.monotonic()
        self.failed_at = self.cancel_at = None
        self.callback_error: Optional[BaseException] = None
        self.beats = {worker.rank: (self.control.heartbeat(worker.rank), now) for worker in workers}
        self.blocks, self.block_at, self.block_s = self._blocks_done(), now, 0.0
        self.progress_at = now  # the last time a block passed or a CPU worker computed
        self.cpu = {worker.rank: _CpuMeter(worker.psutil_process(), now) for worker in workers
                    if worker.device.startswith("cpu")}

    def run(self) -> list[dict]:
        while self.pending:
            for conn in wait(list(self.pending), timeout=POLL_S):
                self._receive(conn)
            now = time.monotonic()
            for worker in self.pending.values():
                if not worker.alive():
                    raise self.exchange.worker_died(worker, self.op)
            self._watch_heartbeats(now)
            self._measure_blocks(now)
            self._measure_cpu(now)
            self._check_failures(now)
            self._check_cancel(now)
            self._check_stall(now)
        if self.block_s:
            self.exchange.block_s = self.block_s
        return [self.replies[rank] for rank in range(len(self.replies))]

    def _receive(self, conn) -> None:
        worker = self.pending[conn]
        try:
            reply = recv(conn)
        except (EOFError, OSError):
            raise self.exchange.worker_died(worker, self.op) from None
        if "progress" in reply:
            if self.on_progress is not None and reply.get("id") == self.message["id"]:
                self.on_progress(reply["progress"], reply.get("message", ""))
        elif reply.get("id") == self.message["id"]:
            self.replies[worker.rank] = reply
            del self.pending[conn]

    def _watch_heartbeats(self, now: float) -> None:
        for worker in self.pending.values():
            beat = self.control.heartbeat(worker.rank)
            last, since = self.beats[worker.rank]
            if beat != last:
                self.beats[worker.rank] = (beat, now)
            elif now - since > self.exchange.timeouts.watchdog_s:
                raise self.exchange.worker_hung(worker, self.op, now - since)

    def _blocks_done(self) -> int:
        return max((self.control.counter(rank) for rank in self.beats), default=0)

    def _measure_blocks(self, now: float) -> None:
        blocks = self._blocks_done()
        if blocks != self.blocks:
            self.block_s = max(self.block_s, now - self.block_at)
            self.blocks, self.block_at = blocks, now
            self.progress_at = now

    def _measure_cpu(self, now: float) -> None:
        for worker in self.pending.values():
            meter = self.cpu.get(worker.rank)
            if meter is not None and meter.computed(now):
                self.progress_at = now

    def _check_stall(self, now: float) -> None:
        if not self.pending or self.op != "call" or self.cancel_at is not None:
            return
        if now - self.progress_at > self.exchange.stall_limit_s(self.block_s):
            raise self.exchange.call_stalled(list(self.pending.values()), self.op, now - self.progress_at)

    def _check_failures(self, now: float) -> None:
        if not self.pending or all(reply["ok"] for reply in self.replies.values()):
            return
        self.failed_at = self.failed_at or now
        if now - self.failed_at > self.exchange.timeouts.error_grace_s:
            late = sorted(worker.rank for worker in self.pending.values())
            self.exchange.on_break(f"ranks {late} did not answer after another rank failed")
            raise self.exchange.remote_error(self.replies, self.op, restarted=True)

    def _check_cancel(self, now: float) -> None:
        if not self.pending:
            return
        if self.cancel_at is None and self.should_cancel is not None and self._cancel_wanted():
            self.control.set_cancel(True)
            self.cancel_at = now
        if self.cancel_at is None:
            return
        # The current block must be allowed to finish: while the workers compute, wait; once they make no progress,
        # wait a multiple of the slowest block measured so far (at least cancel_grace_s), then restart.
        grace = self.exchange.cancel_grace_s(self.block_s)
        if now - max(self.cancel_at, self.progress_at) > grace:
            self.exchange.on_break(f"the workers made no progress for {grace:.1f} s after a cancel")
            raise Cancelled(f"cancelled; the workers made no progress for {grace:.1f} s after the cancel (no block "
                            f"check passed, no CPU worker computing), so the pool restarts on the next call")

    def _cancel_wanted(self) -> bool:
        try:
            return bool(self.should_cancel())
        except Exception as error:  # noqa: BLE001 - a failing callback cancels gracefully, then its error is raised
            log.warning("the cancel callback raised %s: cancelling the call", type(error).__name__)
            self.callback_error = error
            return True


class _CpuMeter:
    """Whether a CPU worker computes: its CPU time (all threads) over the last CPU_WINDOW_S, sampled."""

    def __init__(self, process, now: float):
        self._process = process  # psutil.Process, or None: no CPU signal
        first = self._seconds()
        self._samples = collections.deque([(now, first)] if first is not None else [])

    def _seconds(self) -> Optional[float]:
        try:
            times = self._process.cpu_times() if self._process is not None else None
        except Exception:  # noqa: BLE001 - gone, or not readable: no CPU signal (blocks still count)
            return None
        return None if times is None else times.user + times.system

    def computed(self, now: float) -> bool:
        if not self._samples or now - self._samples[-1][0] < CPU_SAMPLE_S:
            return False
        cpu = self._seconds()
        if cpu is None:
            return False
        self._samples.append((now, cpu))
        while len(self._samples) > 2 and now - self._samples[1][0] >= CPU_WINDOW_S:
            self._samples.popleft()
        start, start_cpu = self._samples[0]
        return cpu - start_cpu >= max(CPU_BUSY_MIN_S, CPU_BUSY_SHARE * (now - start))


def call_message(handle, x: torch.Tensor, timestep: torch.Tensor, kwargs: dict, inputs: InputArena,
                 outputs: OutputArena) -> tuple[dict, dict[str, int]]:
    """The "call" request of one forward: arguments staged in the input arena (x always copied, unchanged
    conditioning not), the output region; returns (message, bytes copied per argument)."""
    tensors: dict[str, torch.Tensor] = {}
    args = {"x": encode_tree(x, "x", tensors), "timestep": encode_tree(timestep, "timestep", tensors),
            "kwargs": {"dict": {key: encode_tree(value, key, tensors) for key, value in kwargs.items()}}}
    with torch.no_grad():
        specs, copied = inputs.stage(tensors, always_copy=frozenset({"x"}))
    region = outputs.region(x.dtype, handle.info.output_shape(tuple(x.shape)))
    return {"op": "call", "key": handle.key, "input_segment": inputs.segment.name, "tensors": specs,
            "live": inputs.live_versions(), "args": args, "output": region}, copied


def tail_of(worker: WorkerProcess, inline: bool = False) -> str:
    """The end of a worker's log; inline: named without its path (for errors raised after the folder is gone)."""
    tail = worker.log_tail()
    name = f"rank {worker.rank}'s log" if inline else worker.log_path
    return f"--- last lines of {name} ---\n{tail}" if tail else ""
