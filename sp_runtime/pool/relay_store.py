"""The rendezvous store of a pool that spans machines: a torch.distributed HashStore in the host process, reached by
every worker through the host's join listener with a per-start secret (torch's own TCPStore listens on every
interface and authenticates nobody). `RelayStore` is the workers' side, `StoreSession` the host's.
"""
from __future__ import annotations

import datetime
import secrets
import socket
import threading

import torch.distributed as dist

from .wire import WireError, proof, proof_matches, recv_frame, send_frame

PURPOSE = "store"


class StoreSession:
    """The store of one pool start: its secret (given to that start's workers only) and its keys."""

    def __init__(self, timeout_s: float):
        self.secret = secrets.token_hex(32)
        self.store = dist.HashStore()
        self.store.set_timeout(datetime.timedelta(seconds=timeout_s))
        self.closed = False

    def accepts(self, challenge: str, answer) -> bool:
        return not self.closed and proof_matches(self.secret.encode(), challenge, PURPOSE, answer)

    def serve(self, sock: socket.socket) -> None:
        """Answer one worker's store operations until it disconnects (one thread per worker)."""
        try:
            while not self.closed:
                header, payload = recv_frame(sock)
                try:
                    reply, data = self._run(header, payload)
                except Exception as error:  # noqa: BLE001 - the worker raises it (e.g. a wait that timed out)
                    reply, data = {"error": f"{type(error).__name__}: {error}"}, b""
                send_frame(sock, reply, data)
        except (WireError, OSError):
            pass
        finally:
            sock.close()

    def _run(self, header: dict, payload: bytes) -> tuple[dict, bytes]:
        op, store = header.get("op"), self.store
        if op == "set":
            store.set(header["key"], payload)
        elif op == "get":
            return {}, store.get(header["key"])
        elif op == "add":
            return {"value": store.add(header["key"], int(header["amount"]))}, b""
        elif op == "compare_set":
            split = int(header["expected_len"])
            return {}, store.compare_set(header["key"], payload[:split], payload[split:])
        elif op == "wait":
            store.wait(list(header["keys"]))
        elif op == "check":
            return {"value": store.check(list(header["keys"]))}, b""
        elif op == "delete_key":
            return {"value": store.delete_key(header["key"])}, b""
        elif op == "num_keys":
            return {"value": store.num_keys()}, b""
        else:
            raise ValueError(f"unknown store operation {op!r}")
        return {}, b""


class RelayStore(dist.Store):
    """A worker's store: every operation is one frame to the host's join listener and its answer."""

    def __init__(self, host: str, port: int, secret: str, timeout_s: float):
        super().__init__()
        self._lock = threading.Lock()
        self._sock = socket.create_connection((host, port), timeout=timeout_s)
        self._sock.settimeout(None)
        challenge, _ = recv_frame(self._sock)
        send_frame(self._sock, {"kind": "store", "proof": proof(secret.encode(), challenge["challenge"], PURPOSE)})
        answer, _ = recv_frame(self._sock)
        if not answer.get("ok"):
            raise ConnectionError(f"the host refused this worker's store connection: {answer.get('refused')}")

    def _ask(self, header: dict, payload: bytes = b"") -> tuple[dict, bytes]:
        with self._lock:
            send_frame(self._sock, header, payload)
            reply, data = recv_frame(self._sock)
        if "error" in reply:
            raise RuntimeError(f"rendezvous store on the host: {reply['error']}")
        return reply, data

    def set(self, key, value) -> None:
        self._ask({"op": "set", "key": key}, _bytes(value))

    def get(self, key) -> bytes:
        return self._ask({"op": "get", "key": key})[1]

    def add(self, key, amount) -> int:
        return self._ask({"op": "add", "key": key, "amount": int(amount)})[0]["value"]

    def compare_set(self, key, expected, desired) -> bytes:
        expected, desired = _bytes(expected), _bytes(desired)
        return self._ask({"op": "compare_set", "key": key, "expected_len": len(expected)}, expected + desired)[1]

    def wait(self, keys, timeout=None) -> None:
        self._ask({"op": "wait", "keys": list(keys)})

    def check(self, keys) -> bool:
        return self._ask({"op": "check", "keys": list(keys)})[0]["value"]

    def delete_key(self, key) -> bool:
        return self._ask({"op": "delete_key", "key": key})[0]["value"]

    def num_keys(self) -> int:
        return self._ask({"op": "num_keys"})[0]["value"]


def _bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
