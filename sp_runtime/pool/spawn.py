"""Starting workers: a fresh interpreter per worker with its control pipe, environment and log file, in the pool's
private run folder, and the rendezvous store (a file in that folder) that the workers join.

Workers are `python -m sp_runtime.pool.worker` started with subprocess, not multiprocessing's spawn: under ComfyUI
the spawn start method re-imports the parent's __main__ (ComfyUI's main.py) in every worker.
"""
from __future__ import annotations

import logging
import os
import queue
import re
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Optional

from ..local_ranks import loopback_interface
from .errors import describe_exit
from .ownership import TOKEN_HEX, OwnerLock, owner_is_dead
from .protocol import send

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


def _new_spawner_in_child() -> None:
    """After os.fork: the serving thread (and any holder of its lock) stayed in the parent."""
    global _spawner
    _spawner = _Spawner()


os.register_at_fork(after_in_child=_new_spawner_in_child)
RUN_DIR_PREFIX = "usp_"
_RUN_DIR = re.compile(rf"^{RUN_DIR_PREFIX}\d+_[0-9a-f]{{{TOKEN_HEX}}}_")
OWNER_FILE = "owner.lock"


class RunFolder:
    """A pool's private (0700) folder for worker logs and the rendezvous store, and the workers' working directory.

    Named usp_<pid>_<pool token>_..., with an owner file locked while the pool lives (see ownership.py). A folder
    that disappeared (a /tmp cleaner) is made again by ensure(), which every pool start calls.
    """

    def __init__(self, token: str):
        self._token = token
        self.path = ""
        self._owner: Optional[OwnerLock] = None

    def ensure(self) -> str:
        if not self.path or not os.path.isdir(self.path):
            self.forget()  # the owner file went with the folder
            self.path = tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}_{self._token}_")
            self._owner = OwnerLock(os.path.join(self.path, OWNER_FILE))
        return self.path

    def remove(self) -> None:
        if self.path:
            shutil.rmtree(self.path, ignore_errors=True)
        self.forget()

    def forget(self) -> None:
        """Let go of the owner file's descriptor and leave the folder as it is (also: in a forked child)."""
        if self._owner is not None:
            self._owner.forget()
            self._owner = None


def clean_stale_run_dirs() -> list[str]:
    """Remove the run folders of pools that died without closing (owner file unlocked); never a live pool's, nor a
    folder without an owner file. Returns the paths removed."""
    root = tempfile.gettempdir()
    paths = [os.path.join(root, name) for name in os.listdir(root) if _RUN_DIR.match(name)]
    return [path for path in paths if remove_if_dead(path)]


def remove_if_dead(run_dir: str) -> bool:
    """Remove one pool's run folder when its owner file proves the pool dead (also: a worker whose host died)."""
    if not owner_is_dead(os.path.join(run_dir, OWNER_FILE)):
        return False
    shutil.rmtree(run_dir, ignore_errors=True)
    return True


def worker_env(extra: Optional[dict] = None) -> dict:
    env = dict(os.environ)
    # The worker is a fresh interpreter running `-m sp_runtime.pool.worker`: ComfyUI imports this package under a
    # name made from its folder path, so the folder that holds sp_runtime must be on the child's path.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    loopback = loopback_interface()
    if loopback:  # keep gloo / NCCL bootstrap sockets on the loopback interface (one machine, nothing exposed)
        env.setdefault("GLOO_SOCKET_IFNAME", loopback)
        env.setdefault("NCCL_SOCKET_IFNAME", loopback)
    env.update(extra or {})
    return env


class Rendezvous:
    """The rendezvous store of one start: a torch.distributed FileStore in the pool's owner-only run folder.

    A file, not a TCPStore: TCPStore has no authentication (any local user could connect, read and write its keys
    and hold connections open); a file in a 0700 folder is reachable by this user only, and nothing listens.
    """

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, f"store-{secrets.token_hex(8)}")
        os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, stat.S_IRUSR | stat.S_IWUSR))

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


@dataclass
class WorkerProcess:
    rank: int
    device: str
    process: subprocess.Popen
    conn: Connection
    log_path: str
    ready: bool = False
    _psutil: object = field(default=None, repr=False, compare=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    def psutil_process(self):
        """psutil's handle on this worker (its CPU time, for the stall watch), made once per worker rather than per
        call; None without psutil or once the process is gone."""
        if self._psutil is None:
            try:
                import psutil
                self._psutil = psutil.Process(self.pid)
            except Exception:  # noqa: BLE001 - psutil missing or the process gone: no CPU signal
                self._psutil = False
        return self._psutil or None

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
    fd = child_end.fileno()
    try:
        with open(log_path, "ab") as log_file:  # argv (world-readable in /proc) holds the pipe's number only
            process = _spawner.popen([sys.executable, "-m", "sp_runtime.pool.worker", str(fd)],
                                     pass_fds=(fd,), stdin=subprocess.DEVNULL, stdout=log_file,
                                     stderr=subprocess.STDOUT, env=env, cwd=run_dir)
    except BaseException:
        parent_end.close()
        raise
    finally:
        child_end.close()
    conn = Connection(parent_end.detach())
    try:
        send(conn, {**spec, "rank": rank})  # the spec (segment and store names) goes over the private pipe
    except OSError:
        pass  # the worker died at once: the pool's start-up wait reports how
    return WorkerProcess(rank, device, process, conn, log_path)
