"""The host side of a pool that spans machines: the join listener (one port: joining machines and the workers'
rendezvous store), each joined machine's connection, and its ranks as workers the pool drives like local ones.

A joined machine gets each request once (not once per rank), with the bytes of the call's inputs it does not hold
yet (its mirror of the input arena keeps the rest) and of a new LoRA patch set; it answers with its ranks' replies
and the output bytes they wrote. Its heartbeats and block counters are written into the host's control block, so
the pool's watchdogs see remote ranks as they see local ones. Only JSON headers and raw tensor bytes travel.
"""
from __future__ import annotations

import json
import logging
import socket
import threading
import time
from multiprocessing.connection import Connection
from typing import Optional

from ..devices import local_device, machine_of
from .identity import file_identity
from .relay_store import StoreSession
from .segments import Segment
from .wire import HELLO_LIMIT, WireError, new_challenge, proof_matches, read_token, recv_frame, send_frame

log = logging.getLogger("ulysses_sp.pool")
HANDSHAKE_S = 10.0
SEND_TIMEOUT_S = 30.0
JOIN_PURPOSE = "join"


def parse_address(text: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """'HOST:PORT', ':PORT' or 'PORT' -> (host, port)."""
    host, _, port = str(text).rpartition(":")
    try:
        return host.strip("[]") or default_host, int(port)
    except ValueError:
        raise ValueError(f"address {text!r} is not HOST:PORT (e.g. 192.168.1.10:29600)") from None


def interface_of(address: str) -> Optional[str]:
    """The network interface that holds `address` (gloo / NCCL use it for their sockets), or None."""
    try:
        import psutil
        return next((name for name, addresses in psutil.net_if_addrs().items()
                     if any(entry.address == address for entry in addresses)), None)
    except Exception:  # noqa: BLE001 - no psutil: the libraries pick an interface themselves
        return None


class JoinPoint:
    """Listens on one address (127.0.0.1 unless the user names an interface) for machines that join the pool and
    for the workers' store connections; every connection proves it knows a secret before anything else."""

    def __init__(self, address: str, token_file: str, expected: dict[str, list[str]]):
        self.token = read_token(token_file)
        self.expected = expected  # machine -> the devices the pool runs there
        host, port = parse_address(address)
        self._sock = socket.create_server((host, port), reuse_port=False)
        self.host, self.port = self._sock.getsockname()[:2]
        self.machines: dict[str, Machine] = {}
        self.store: Optional[StoreSession] = None
        self.refusals: list[str] = []  # what was refused and why (also logged)
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="usp-join", daemon=True).start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def new_store(self, timeout_s: float) -> StoreSession:
        if self.store is not None:
            self.store.closed = True
        self.store = StoreSession(timeout_s)
        return self.store

    def local_env(self) -> dict:
        """The host's workers' gloo / NCCL sockets on the listener's interface (the loopback one by default)."""
        interface = interface_of(self.host)
        return {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": interface} if interface else {}

    def release(self) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        if self.store is not None:
            self.store.closed = True
        try:
            self._sock.close()
        except OSError:
            pass
        for machine in list(self.machines.values()):
            machine.disconnect()

    # ---- connections ----------------------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handshake, args=(conn, f"{peer[0]}:{peer[1]}"), daemon=True).start()

    def _handshake(self, conn: socket.socket, peer: str) -> None:
        challenge = new_challenge()
        try:
            conn.settimeout(HANDSHAKE_S)
            send_frame(conn, {"challenge": challenge})
            hello, _ = recv_frame(conn, HELLO_LIMIT)
            conn.settimeout(None)
            if hello.get("kind") == "store" and self.store is not None and self.store.accepts(challenge,
                                                                                               hello.get("proof")):
                send_frame(conn, {"ok": True})
                self.store.serve(conn)
            elif hello.get("kind") == "machine":
                self._admit(conn, peer, challenge, hello)
            else:
                self._refuse(conn, peer, "wrong secret or unknown connection kind")
        except (WireError, OSError, ValueError, KeyError, TypeError) as error:
            log.warning("join listener: a connection from %s failed: %s", peer, error)
            conn.close()

    def _admit(self, conn: socket.socket, peer: str, challenge: str, hello: dict) -> None:
        if not proof_matches(self.token, challenge, JOIN_PURPOSE, hello.get("proof")):
            self._refuse(conn, peer, "wrong token (the joiner's token file differs from the host's)")
            return
        name, offered = str(hello.get("name", "")), [str(device) for device in hello.get("devices", [])]
        with self._lock:
            reason = self._refusal(name, offered)
            if reason is None:
                self.machines[name] = Machine(self, name, conn, peer)
        if reason is not None:
            self._refuse(conn, peer, reason, retry=self._closed)
            return
        send_frame(conn, {"ok": True, "devices": self.expected[name]})
        log.info("machine %s joined from %s", name, peer)
        self.machines[name].start_reading()

    def _refusal(self, name: str, offered: list[str]) -> Optional[str]:
        if self._closed:
            return "the pool is closed"
        if name not in self.expected:
            return (f"this host's pool has no devices on machine {name!r} (it names machines "
                    f"{sorted(self.expected)}): join with --name one of those, or list {name}:<devices> on the host")
        if name in self.machines and self.machines[name].connected:
            return f"machine {name!r} has already joined (from {self.machines[name].peer}): a duplicate is refused"
        wanted = self.expected[name]
        missing = [device for device in set(wanted) if wanted.count(device) > offered.count(device)]
        if missing:
            return (f"the pool needs devices {wanted} on machine {name!r}, but it offers {offered}: join with "
                    f"--devices covering {wanted}")
        return None

    def _refuse(self, conn: socket.socket, peer: str, reason: str, retry: bool = False) -> None:
        """Refuse a connection (logged); retry: the joiner may try again later (the pool is closing)."""
        log.warning("join listener: refused %s: %s", peer, reason)
        self.refusals.append(reason)
        try:
            send_frame(conn, {"ok": False, "refused": reason, "retry": retry})
        except OSError:
            pass
        conn.close()

    def _forget(self, machine: "Machine") -> None:
        with self._lock:
            if self.machines.get(machine.name) is machine:
                del self.machines[machine.name]

    # ---- starting the remote ranks --------------------------------------------------------------------------
    def start_workers(self, config, spec: dict, control, deadline: float) -> list["RemoteWorker"]:
        """Start every joined machine's ranks (waiting until `deadline` for machines that have not joined yet)."""
        workers = []
        for name in [machine for machine in config.machines if machine]:
            machine = self._wait_for(name, config, deadline)
            ranks = [rank for rank in range(config.world_size) if machine_of(config.devices[rank]) == name]
            workers.extend(machine.start(ranks, config, spec, control))
        return workers

    def _wait_for(self, name: str, config, deadline: float) -> "Machine":
        while True:
            machine = self.machines.get(name)
            if machine is not None and machine.connected and not machine.started:
                return machine
            if time.monotonic() > deadline or self._closed:
                from .errors import PoolStartError
                devices = ",".join(local_device(d) for d in config.devices if machine_of(d) == name)
                raise PoolStartError(
                    f"machine {name!r} has not joined within the start timeout: on it run `python -m sp_runtime join "
                    f"{self.address} --token-file <token file> --name {name} --devices {devices} --models <models "
                    f"folder>`" + (f" (last refusal: {self.refusals[-1]})" if self.refusals else ""),
                    None, f"{name}:{devices}")
            time.sleep(0.05)


class Machine:
    """One joined machine's connection: requests out (once per request), replies, output bytes and beats in."""

    def __init__(self, point: JoinPoint, name: str, sock: socket.socket, peer: str):
        self.point, self.name, self.sock, self.peer = point, name, sock, peer
        _limit_send_time(sock, SEND_TIMEOUT_S)  # a machine that stops reading fails the request, never hangs it
        self.connected = True
        self.started = False
        self.workers: dict[int, RemoteWorker] = {}
        self.control = None
        self._send_lock = threading.Lock()
        self._segments_lock = threading.Lock()  # the reader thread writes outputs while the pool's thread may disconnect
        self._last_request = None
        self._held: dict[tuple, tuple[int, int]] = {}  # input tensors the machine holds: spec key -> byte range
        self._mirrored = None  # the host input segment the machine mirrors
        self._inputs_at: Optional[Segment] = None  # the host's input segment (read by the pool's thread)
        self._outputs_at: Optional[Segment] = None  # the host's output segment (written by the reader thread)
        self._cancel = False
        self._probe = threading.Event()

    def probe(self, nbytes: int, repeats: int = 3) -> float:
        """The link to this machine: bytes per second one way, from the best of `repeats` round trips of nbytes
        each way (the doctor's inter-machine measurement; the machine must be joined and idle)."""
        payload = bytes(nbytes)
        best = float("inf")
        for _ in range(repeats):
            self._probe.clear()
            started = time.perf_counter()
            self._send({"probe": nbytes}, payload)
            if not self._probe.wait(timeout=120):
                raise TimeoutError(f"machine {self.name!r} did not answer the link probe within 120 s")
            best = min(best, time.perf_counter() - started)
        return 2 * nbytes / best

    def start_reading(self) -> None:
        threading.Thread(target=self._read, name=f"usp-machine-{self.name}", daemon=True).start()

    def start(self, ranks: list[int], config, spec: dict, control) -> list["RemoteWorker"]:
        self.started, self.control = True, control
        self.workers = {rank: RemoteWorker(self, rank, config.devices[rank]) for rank in ranks}
        self._send({"start": {"ranks": ranks, "spec": spec}})
        return list(self.workers.values())

    def disconnect(self, reason: str = "left the pool") -> None:
        """Drop the connection: the machine stops its workers and joins again for the pool's next start."""
        if self.connected:
            self.connected = False
            for worker in self.workers.values():
                worker.exited = worker.exited or f"lost: machine {self.name!r} {reason}"
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()
        with self._segments_lock:
            for segment in (self._inputs_at, self._outputs_at):
                if segment is not None:
                    segment.release()
            self._inputs_at = self._outputs_at = None
        self._mirrored = None
        self.point._forget(self)

    # ---- requests out ---------------------------------------------------------------------------------------
    def forward(self, message: dict) -> None:
        """Send a request once for all of this machine's ranks (the pool sends it to each rank)."""
        marker = (message.get("id"), message.get("op"))
        if marker == self._last_request:
            return
        self._last_request = marker
        # the cancel flag as the host holds it now (a request clears it): the one last sent may be a cancelled
        # call's, and the next beat could come after this request's first block check
        self._cancel = self.control.cancel_requested() if self.control is not None else False
        header, payload = {"request": message, "cancel": self._cancel}, []
        if message["op"] == "call":
            header["inputs"] = self._inputs(message, payload)
        elif message["op"] == "load":
            header["identity"] = file_identity(message["request"]["path"])
        elif message["op"] == "set_loras":
            header["lora_identity"] = [file_identity(path) for path, _ in message["loras"]]
            patches = message.get("patches")
            if patches and "set" in patches:
                header["patch_bytes"] = self._patch_bytes(patches, payload)
        self._send(header, b"".join(payload))

    def _inputs(self, message: dict, payload: list) -> dict:
        """The input tensors the machine does not hold yet: their byte ranges, their bytes appended to payload."""
        if message["input_segment"] != self._mirrored:  # the host's arena moved: the machine holds nothing of it
            with self._segments_lock:
                self._inputs_at = _reattach(self._inputs_at, message["input_segment"])
            self._mirrored, self._held = message["input_segment"], {}
        segment = self._inputs_at
        sent = []
        for spec in message["tensors"]:
            key = (spec["offset"], spec["dtype"], tuple(spec["shape"]), spec["version"])
            start = spec["offset"]
            end = start + _nbytes(spec)
            if key in self._held:
                continue
            self._held = {k: span for k, span in self._held.items() if span[1] <= start or span[0] >= end}
            self._held[key] = (start, end)
            sent.append([start, end - start])
            payload.append(segment.base[start:end].numpy().tobytes())
        return {"segment_size": segment.size, "ranges": sent}

    def _patch_bytes(self, patches: dict, payload: list) -> int:
        segment = Segment.attach(patches["segment"])  # lives for one request
        try:
            size = max((spec["offset"] + _nbytes(spec) for spec in patches["tensors"]), default=0)
            payload.append(segment.base[:size].numpy().tobytes())
        finally:
            segment.release()
        return size

    def _send(self, header: dict, payload: bytes = b"") -> None:
        if not self.connected:
            raise OSError(f"machine {self.name!r} is not connected")
        try:
            with self._send_lock:
                send_frame(self.sock, header, payload)
        except OSError as error:
            self.disconnect(f"stopped taking requests ({type(error).__name__}: {error})")
            raise

    # ---- replies in -----------------------------------------------------------------------------------------
    def _read(self) -> None:
        try:
            while self.connected:
                header, payload = recv_frame(self.sock)
                self._receive(header, payload)
        except (WireError, OSError, ValueError) as error:
            if self.connected:
                log.warning("machine %s (%s) left: %s", self.name, self.peer, error)
        finally:
            self.disconnect()

    def _receive(self, header: dict, payload: bytes) -> None:
        if "probe" in header:
            self._probe.set()
        if "beat" in header:
            self._beat(header["beat"])
        if "output" in header:
            self._write_output(header["output"], payload)
        for rank, message in header.get("messages", []):
            worker = self.workers.get(int(rank))
            if worker is not None:
                if message.get("event") == "ready":
                    worker.remote_pid = message.get("pid")
                worker.deliver(message)
        for rank, cause, tail in header.get("exited", []):
            worker = self.workers.get(int(rank))
            if worker is not None:
                worker.exited, worker.tail = cause, tail

    def _beat(self, beat: dict) -> None:
        control = self.control
        if control is None:
            return
        for rank, (heartbeat, counter) in beat.items():
            control.mirror(int(rank), heartbeat, counter)
        if control.cancel_requested() != self._cancel:
            self._cancel = control.cancel_requested()
            self._send({"cancel": self._cancel})

    def _write_output(self, output: dict, payload: bytes) -> None:
        with self._segments_lock:
            if not self.connected:
                return  # disconnected meanwhile: the call has failed, nobody reads this output
            if self._outputs_at is None or self._outputs_at.name != output["segment"]:
                self._outputs_at = _reattach(self._outputs_at, output["segment"])
            base = self._outputs_at.base
            at = 0
            for start, length in output["ranges"]:
                base[start:start + length].copy_(_as_bytes(payload[at:at + length]))
                at += length


class RemoteWorker:
    """A rank on a joined machine, with the interface of a local WorkerProcess (what the pool and Exchange use)."""

    def __init__(self, machine: Machine, rank: int, device: str):
        self.machine, self.rank, self.device = machine, rank, device
        ours, theirs = socket.socketpair()
        self._inbox = Connection(theirs.detach())
        self.conn = RemoteConn(Connection(ours.detach()), machine)
        self.log_path = f"machine {machine.name}'s rank {rank} log"
        self.ready = False
        self.exited: Optional[str] = None
        self.tail = ""
        self.remote_pid: Optional[int] = None

    @property
    def pid(self) -> Optional[int]:
        return self.remote_pid  # on the joined machine

    def deliver(self, message: dict) -> None:
        try:
            self._inbox.send_bytes(json.dumps(message).encode())
        except OSError:
            pass

    def psutil_process(self):
        return None  # another machine's process: progress shows as blocks passed only

    def alive(self) -> bool:
        return self.exited is None and self.machine.connected

    def exit_cause(self, wait_s: float = 0.0) -> str:
        deadline = time.monotonic() + wait_s
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        cause = self.exited or ("lost: its machine left" if not self.machine.connected else "is running")
        return f"on machine {self.machine.name!r} {cause}"

    def log_tail(self, lines: int = 15) -> str:
        return "\n".join(self.tail.splitlines()[-lines:])

    def kill(self) -> None:
        self.machine.disconnect()

    def reap(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while self.machine.connected and any(w.exited is None for w in self.machine.workers.values()) \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        self.machine.disconnect()
        self.conn.close()
        self._inbox.close()


class RemoteConn:
    """The pool's pipe to a remote rank: replies are read from a local socket pair, requests go to the machine."""

    def __init__(self, inbox: Connection, machine: Machine):
        self._inbox, self._machine = inbox, machine

    def fileno(self) -> int:
        return self._inbox.fileno()

    def recv_bytes(self) -> bytes:
        return self._inbox.recv_bytes()

    def send_bytes(self, data: bytes) -> None:
        self._machine.forward(json.loads(data))

    def close(self) -> None:
        self._inbox.close()


def _limit_send_time(sock: socket.socket, seconds: float) -> None:
    """An OS send timeout (sends only: the reader thread's receives wait as long as the machine is joined)."""
    import struct
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(seconds), 0))
    except (OSError, AttributeError, struct.error):
        pass


def _reattach(old: Optional[Segment], name: str) -> Segment:
    """The host segment `name` attached here, the one attached before let go."""
    if old is not None:
        old.release()
    return Segment.attach(name)


def _nbytes(spec: dict) -> int:
    from .protocol import name_to_dtype
    count = name_to_dtype(spec["dtype"]).itemsize
    for size in spec["shape"]:
        count *= int(size)
    return count


def _as_bytes(data: bytes):
    import torch
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
