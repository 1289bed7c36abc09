"""Starting workers: a fresh interpreter per worker with its control pipe, environment and log file, and the
rendezvous store on 127.0.0.1 that the workers join.

Workers are `python -m sp_runtime.pool.worker` started with subprocess, not multiprocessing's spawn: under ComfyUI
the spawn start method re-imports the parent's __main__ (ComfyUI's main.py) in every worker.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Optional

import torch.distributed as dist

from .errors import describe_exit
from .segments import pid_alive

log = logging.getLogger("ulysses_sp.pool")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Spawner:
    """Runs every Popen on one daemon thread that lives as long as the process.

    Workers set PR_SET_PDEATHSIG, which fires when the *thread* that forked them ends, not the process: forking from
    a short-lived caller thread (a thread pool, a web handler) would kill healthy workers when that thread ends.
    """

    def __init__(self):
        self._requests: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    def popen(self, *args, **kwargs) -> subprocess.Popen:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name="usp-spawner", daemon=True)
                self._thread.start()
        future: Future = Future()
        self._requests.put((future, args, kwargs))
        return future.result()

    def _serve(self) -> None:
        while True:
            future, args, kwargs = self._requests.get()
            try:
                future.set_result(subprocess.Popen(*args, **kwargs))
            except BaseException as error:  # noqa: BLE001 - handed to the caller
                future.set_exception(error)


_spawner = _Spawner()
RUN_DIR_PREFIX = "usp_"
_RUN_DIR = re.compile(rf"^{RUN_DIR_PREFIX}(\d+)_")


def new_run_dir() -> str:
    """A private (0700) folder for one pool's worker logs; also the workers' working directory."""
    return tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}_")


def clean_stale_run_dirs() -> None:
    """Remove run folders of pools whose process is gone (killed before it could close its pool)."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        match = _RUN_DIR.match(name)
        path = os.path.join(root, name)
        if match and not pid_alive(int(match.group(1))) and os.path.isdir(path) and \
                os.stat(path).st_uid == os.getuid():
            shutil.rmtree(path, ignore_errors=True)


def _loopback_interface() -> Optional[str]:
    try:
        return next((name for _, name in socket.if_nameindex() if name in ("lo", "lo0")), None)
    except OSError:
        return None


def worker_env(extra: Optional[dict] = None) -> dict:
    env = dict(os.environ)
    # The worker is a fresh interpreter running `-m sp_runtime.pool.worker`: ComfyUI imports this package under a
    # name made from its folder path, so the folder that holds sp_runtime must be on the child's path.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    loopback = _loopback_interface()
    if loopback:  # keep gloo / NCCL bootstrap sockets on the loopback interface (one machine, nothing exposed)
        env.setdefault("GLOO_SOCKET_IFNAME", loopback)
        env.setdefault("NCCL_SOCKET_IFNAME", loopback)
    env.update(extra or {})
    return env


class Rendezvous:
    """The torch.distributed TCPStore, served by the pool's process on a socket bound to 127.0.0.1 only."""

    def __init__(self, timeout):
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        self.port = listener.getsockname()[1]
        try:  # the store takes the bound socket: no race for the port, and no wildcard bind
            self.store = dist.TCPStore("127.0.0.1", self.port, is_master=True, wait_for_workers=False,
                                       timeout=timeout, master_listen_fd=listener.fileno(), use_libuv=True)
            listener.detach()  # the store owns (and closes) the descriptor now
        except (RuntimeError, TypeError, ValueError) as error:
            listener.close()
            log.warning("TCPStore could not adopt a 127.0.0.1 socket (%s); it binds the wildcard address", error)
            self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
            self.port = self.store.port

    def close(self) -> None:
        self.store = None


@dataclass
class WorkerProcess:
    rank: int
    device: str
    process: subprocess.Popen
    conn: Connection
    log_path: str
    ready: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def exit_cause(self, wait_s: float = 0.0) -> str:
        if wait_s:
            try:
                self.process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass
        return describe_exit(self.process.poll())

    def log_tail(self, lines: int = 15) -> str:
        try:
            with open(self.log_path, "rb") as handle:
                handle.seek(max(0, os.path.getsize(self.log_path) - 16384))
                text = handle.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])

    def kill(self) -> None:
        if self.alive():
            try:
                self.process.kill()
            except ProcessLookupError:
                pass

    def reap(self, wait_s: float) -> None:
        try:
            self.process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            self.kill()
            self.process.wait()
        self.conn.close()


def launch_worker(rank: int, device: str, spec: dict, env: dict, run_dir: str) -> WorkerProcess:
    parent_end, child_end = socket.socketpair()
    log_path = os.path.join(run_dir, f"worker{rank}.log")
    spec = {**spec, "rank": rank, "fd": child_end.fileno()}
    try:
        with open(log_path, "ab") as log_file:
            process = _spawner.popen([sys.executable, "-m", "sp_runtime.pool.worker", json.dumps(spec)],
                                     pass_fds=(child_end.fileno(),), stdin=subprocess.DEVNULL, stdout=log_file,
                                     stderr=subprocess.STDOUT, env=env, cwd=run_dir)
    except BaseException:
        parent_end.close()
        raise
    finally:
        child_end.close()
    return WorkerProcess(rank, device, process, Connection(parent_end.detach()), log_path)
