"""The joined machine's side of a pool that spans machines (`python -m sp_runtime join`): one session per
connection to the host. It starts this machine's ranks as ordinary workers (own control block, run folder and
shared memory, none of the host's), hands them each request with inputs mirrored at the host's offsets, maps model
and LoRA files to this machine's models folder (checked against the host's identity), and returns its ranks'
replies, the output bytes they wrote, heartbeats and block counters.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from multiprocessing.connection import wait
from typing import Optional

import torch

from ..checkpoints.header import checkpoint_stamp
from ..contract import LoadRequest
from ..devices import local_device
from .control import HEARTBEAT_S, ControlBlock
from .errors import describe_exit
from .identity import IdentityMismatch, find_local
from .ownership import new_token
from .protocol import name_to_dtype, recv, send
from .remote import JOIN_PURPOSE, interface_of
from .segments import Segment, claim_names, clean_stale_segments
from .spawn import RunFolder, WorkerProcess, clean_stale_run_dirs, launch_worker, worker_env
from .wire import proof, recv_frame, send_frame

log = logging.getLogger("ulysses_sp.join")
# A signalling NaN per element size: arithmetic never produces one, so an element still holding it was not written
SENTINELS = {2: {torch.float16: 0x7D5A, torch.bfloat16: 0x7FA5}, 4: 0x7FA5A5A5, 8: 0x7FF4A5A5A5A5A5A5}
INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


class Refused(Exception):
    """The host refused this machine (wrong token, unknown name, duplicate, devices): joining again will not help."""


def connect(host: str, port: int, token: bytes, name: str, devices: list[str], timeout_s: float = 10.0
            ) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout_s)
    challenge, _ = recv_frame(sock)
    send_frame(sock, {"kind": "machine", "name": name, "devices": devices,
                      "proof": proof(token, challenge["challenge"], JOIN_PURPOSE)})
    answer, _ = recv_frame(sock)
    if not answer.get("ok"):
        sock.close()
        if answer.get("retry"):
            raise ConnectionRefusedError(answer.get("refused", "refused for now"))
        raise Refused(answer.get("refused", "refused"))
    sock.settimeout(None)
    return sock


class Session:
    """One connection to the host: serves until the host drops it, then stops this machine's workers."""

    def __init__(self, sock: socket.socket, name: str, models_dir: str, threads: Optional[int] = None):
        self.sock, self.name, self.models_dir, self.threads = sock, name, models_dir, threads
        self.token = new_token()
        clean_stale_segments()  # what a killed joiner left behind (its owner file unlocked)
        clean_stale_run_dirs()
        self.names = claim_names(self.token)  # proves this session's segments its own to those sweeps
        self.run = RunFolder(self.token)
        self.control: Optional[ControlBlock] = None
        self.workers: dict[int, WorkerProcess] = {}
        self.exited: set[int] = set()
        self.inputs: Optional[Segment] = None
        self.host_inputs = None
        self.outputs: Optional[Segment] = None
        self.pending: Optional[dict] = None  # the request the workers are serving
        self.world = 0
        self.host_output = ""
        self.patches: Optional[Segment] = None

    def serve(self) -> None:
        beat_at = 0.0
        try:
            while True:
                conns = [self.sock] + [w.conn for r, w in self.workers.items() if r not in self.exited]
                for ready in wait(conns, timeout=HEARTBEAT_S):
                    if ready is self.sock:
                        self._from_host(*recv_frame(self.sock))
                    else:
                        self._from_worker(next(w for w in self.workers.values() if w.conn is ready))
                self._watch_exits()
                if time.monotonic() - beat_at >= HEARTBEAT_S:
                    beat_at = time.monotonic()
                    self._beat()
        finally:
            self.close()

    # ---- from the host --------------------------------------------------------------------------------------
    def _from_host(self, header: dict, payload: bytes) -> None:
        if "probe" in header:  # the doctor's link measurement: the same bytes back
            send_frame(self.sock, {"probe": header["probe"]}, payload)
        if "start" in header:
            self._start(header["start"])
        if "cancel" in header and self.control is not None:
            self.control.set_cancel(bool(header["cancel"]))
        if "request" in header:
            self._request(header, payload)

    def _start(self, start: dict) -> None:
        spec = dict(start["spec"])
        self.world = len(spec["config"]["devices"])
        self.control = ControlBlock.create(self.token, self.world)
        run_dir = self.run.ensure()
        host, port = self.sock.getpeername()[:2]
        spec.update(control=self.control.name, run_dir=run_dir, parent_pid=os.getpid(), threads=self.threads,
                    relay_store={**spec["relay_store"], "host": host, "port": port})
        interface = interface_of(self.sock.getsockname()[0])
        env = worker_env({"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": interface} if interface else None)
        for rank in start["ranks"]:
            device = local_device(spec["config"]["devices"][rank])
            self.workers[rank] = launch_worker(rank, device, spec, env, run_dir)
        log.info("started ranks %s for the host", start["ranks"])

    def _request(self, header: dict, payload: bytes) -> None:
        message = header["request"]
        op = message["op"]
        try:
            if op == "call":
                self._stage_call(message, header["inputs"], payload)
            elif op == "load":
                self._local_model(message, header["identity"])
            elif op == "set_loras":
                self._local_loras(message, header["lora_identity"], header.get("patch_bytes"), payload)
        except Exception as error:  # noqa: BLE001 - every rank here answers with it
            from .worker import error_reply
            self._to_host([[rank, {**error_reply(error), "id": message.get("id")}] for rank in self.workers])
            return
        if self.control is not None:
            self.control.set_cancel(bool(header.get("cancel")))
        self.pending = {"message": message, "replies": {}}
        for rank, worker in self.workers.items():
            try:
                send(worker.conn, message)
            except OSError:
                pass  # its exit is reported by the beat

    def _stage_call(self, message: dict, inputs: dict, payload: bytes) -> None:
        if self.host_inputs != message["input_segment"] or self.inputs is None:
            self._replace("inputs", Segment.create(self.token, "i", inputs["segment_size"]))
            self.host_inputs = message["input_segment"]
        at = 0
        for start, length in inputs["ranges"]:
            self.inputs.base[start:start + length].copy_(torch.frombuffer(bytearray(payload[at:at + length]),
                                                                          dtype=torch.uint8))
            at += length
        region = message["output"]
        dtype = name_to_dtype(region["dtype"])
        nbytes = dtype.itemsize * _count(region["shape"])
        if self.outputs is None or self.outputs.size < region["offset"] + nbytes:
            self._replace("outputs", Segment.create(self.token, "o", region["offset"] + nbytes))
        self.host_output = region["segment"]
        _fill_sentinel(self._output_view(region))
        message["input_segment"] = self.inputs.name
        message["output"] = {**region, "segment": self.outputs.name}
        self.control.reset_counters(self.world)

    def _output_view(self, region: dict) -> torch.Tensor:
        dtype = name_to_dtype(region["dtype"])
        return self.outputs.view(region["offset"], dtype, tuple(region["shape"]))

    def _local_model(self, message: dict, identity: dict) -> None:
        request = dict(message["request"])
        host_key = LoadRequest.from_message(request).key
        request["path"] = find_local(identity, self.models_dir, self.name)
        request["stamp"] = checkpoint_stamp(request["path"])
        message["request"], message["as_key"] = request, host_key
        message["shared_weights"] = None  # the host's chunk names mean nothing here

    def _local_loras(self, message: dict, identities: list, patch_bytes: Optional[int], payload: bytes) -> None:
        message["loras"] = [[find_local(identity, self.models_dir, self.name), strength]
                            for identity, (_, strength) in zip(identities, message["loras"])]
        if patch_bytes is not None:
            self._replace("patches", Segment.create(self.token, "p", max(1, patch_bytes)))
            if patch_bytes:
                self.patches.base[:patch_bytes].copy_(torch.frombuffer(bytearray(payload[:patch_bytes]),
                                                                       dtype=torch.uint8))
            message["patches"] = {**message["patches"], "segment": self.patches.name}

    def _replace(self, attribute: str, segment: Segment) -> None:
        old = getattr(self, attribute)
        setattr(self, attribute, segment)
        if old is not None:
            old.release()

    # ---- from the workers -----------------------------------------------------------------------------------
    def _from_worker(self, worker: WorkerProcess) -> None:
        try:
            message = recv(worker.conn)
        except (EOFError, OSError):
            self.exited.add(worker.rank)
            self._to_host([], exited=[[worker.rank, describe_exit(worker.process.wait()), worker.log_tail()]])
            return
        pending = self.pending
        if pending is None or "progress" in message or message.get("id") != pending["message"].get("id"):
            self._to_host([[worker.rank, message]])  # start-up events, progress
            return
        pending["replies"][worker.rank] = message
        if pending["message"]["op"] != "call" or pending.get("failed") or not message.get("ok"):
            pending["failed"] = pending["message"]["op"] == "call"  # the held replies go now, without output
            held = [[rank, reply] for rank, reply in pending["replies"].items() if rank != worker.rank
                    and pending["message"]["op"] == "call" and not pending.get("sent")]
            pending["sent"] = True
            self._to_host(held + [[worker.rank, message]])
            return
        if len(pending["replies"]) == len(self.workers):  # every rank here computed its share: send it
            self.pending = None
            ranges, payload = _written(self._output_view(pending["message"]["output"]),
                                       pending["message"]["output"]["offset"])
            self._to_host([[rank, reply] for rank, reply in pending["replies"].items()],
                          output={"segment": self.host_output, "ranges": ranges}, payload=payload)

    def _watch_exits(self) -> None:
        for rank, worker in self.workers.items():
            if rank not in self.exited and not worker.alive():
                self.exited.add(rank)
                self._to_host([], exited=[[rank, describe_exit(worker.process.poll()), worker.log_tail()]])

    def _beat(self) -> None:
        if self.control is None:
            return
        beat = {rank: [self.control.heartbeat(rank), self.control.counter(rank)] for rank in self.workers}
        send_frame(self.sock, {"beat": beat})

    def _to_host(self, messages: list, exited: Optional[list] = None, output: Optional[dict] = None,
                 payload: bytes = b"") -> None:
        header = {"messages": messages}
        if exited:
            header["exited"] = exited
        if output is not None:
            header["output"] = output
        send_frame(self.sock, header, payload)

    def close(self) -> None:
        for worker in self.workers.values():
            worker.kill()
        for worker in self.workers.values():
            worker.reap(wait_s=5.0)
        self.workers.clear()
        for attribute in ("inputs", "outputs", "patches", "control"):
            part = getattr(self, attribute)
            if part is not None:
                part.release()
                setattr(self, attribute, None)
        self.run.remove()
        if self.names is not None:
            self.names.release()
        try:
            self.sock.close()
        except OSError:
            pass


def _count(shape) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count


def _fill_sentinel(view: torch.Tensor) -> None:
    size = view.element_size()
    if size in INT_OF_SIZE:
        sentinel = SENTINELS[size]
        sentinel = sentinel[view.dtype] if isinstance(sentinel, dict) else sentinel
        view.view(INT_OF_SIZE[size]).fill_(_signed(sentinel, size))


def _written(view: torch.Tensor, offset: int) -> tuple[list, bytes]:
    """The byte ranges of the output region that this machine's ranks wrote (elements no longer the sentinel) and
    their bytes; a 1-byte dtype (no sentinel) sends the whole region."""
    size = view.element_size()
    flat = view.reshape(-1)
    if size not in INT_OF_SIZE or flat.numel() == 0:
        data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        return ([[offset, len(data)]] if data else []), data
    sentinel = SENTINELS[size]
    sentinel = sentinel[view.dtype] if isinstance(sentinel, dict) else sentinel
    written = (flat.view(INT_OF_SIZE[size]) != _signed(sentinel, size)).to(torch.int8)
    edges = torch.diff(torch.cat([torch.zeros(1, dtype=torch.int8), written, torch.zeros(1, dtype=torch.int8)]))
    starts = (edges == 1).nonzero().flatten().tolist()
    ends = (edges == -1).nonzero().flatten().tolist()
    raw = flat.view(torch.uint8)
    ranges, parts = [], []
    for start, end in zip(starts, ends):
        ranges.append([offset + start * size, (end - start) * size])
        parts.append(raw[start * size:end * size].numpy().tobytes())
    return ranges, b"".join(parts)


def _signed(value: int, size: int) -> int:
    bits = 8 * size
    return value - (1 << bits) if value >= 1 << (bits - 1) else value
