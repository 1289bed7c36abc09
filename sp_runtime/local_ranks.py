"""run_distributed: run a function on N spawned gloo ranks (for tests and benchmarks) and collect the results.
spawn_ranks, the process handling underneath, also serves the CLI's link probes (NCCL on GPUs).

Every child is killed and reaped when one fails, when the time runs out, or when the caller is interrupted. The
ranks rendezvous through a FileStore in a private (0700) folder, not a TCPStore (which listens on every interface
without authentication whatever host it is given), and keep gloo / NCCL sockets on the loopback interface.
"""
from __future__ import annotations

import os
import queue
import shutil
import socket
import tempfile
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

_CHILD_EXIT_GRACE_S = 5.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def loopback_interface():
    """The loopback interface's name ("lo", "lo0"), or None."""
    try:
        return next((name for _, name in socket.if_nameindex() if name in ("lo", "lo0")), None)
    except OSError:
        return None


def join_process_group(backend: str, store_path: str, rank: int, world_size: int, **options) -> None:
    """init_process_group over a FileStore, its sockets on the loopback interface (one machine, nothing exposed)."""
    import torch.distributed as dist
    loopback = loopback_interface()
    if loopback:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback)
    dist.init_process_group(backend, store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size,
                            **options)


def _to_bytes(value: Any) -> bytes:
    """Results travel as torch.save bytes: a tensor shared by handle would vanish with the child that made it."""
    import io

    import torch
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> Any:
    import io

    import torch
    return torch.load(io.BytesIO(data), weights_only=True)


def _child(rank: int, store_path: str, results, world_size: int, threads: int, fn: Callable, args: tuple) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(threads)
    try:
        join_process_group("gloo", store_path, rank, world_size)
        try:
            results.put((rank, True, _to_bytes(fn(rank, world_size, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report every failure to the parent, which ends the other ranks
        results.put((rank, False, traceback.format_exc()))


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0,
                    threads: int = 0) -> list[Any]:
    """Run fn(rank, world_size, *args) in world_size processes joined by a gloo process group.

    fn must be importable (module level). Returns the per-rank results in rank order; raises RuntimeError with the
    failing rank's traceback, or TimeoutError.
    """
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    values = spawn_ranks(_child, world_size, (world_size, threads, fn, args), timeout, "distributed run")
    return [_from_bytes(value) for value in values]


def spawn_ranks(child: Callable, world_size: int, child_args: tuple, timeout: float, name: str) -> list[Any]:
    """Run child(rank, store_path, results, *child_args) in world_size spawned processes (store_path: the process
    group's FileStore, for join_process_group) and return, in rank order, the value each puts on `results` as
    (rank, True, value).

    A child reports a failure as (rank, False, traceback); that, a child's death or the timeout raises
    RuntimeError / TimeoutError naming `name`, after every child has been killed and reaped.
    """
    context = mp.get_context("spawn")
    results = context.Queue()
    folder = tempfile.mkdtemp(prefix="usp_ranks_")  # 0700: the store is this user's alone
    store_path = os.path.join(folder, "store")
    processes = [context.Process(target=child, args=(rank, store_path, results, *child_args), daemon=True)
                 for rank in range(world_size)]
    try:
        for process in processes:
            process.start()
        return _collect(results, processes, timeout, name)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(_CHILD_EXIT_GRACE_S)
        results.close()
        shutil.rmtree(folder, ignore_errors=True)


def _collect(results, processes, timeout: float, name: str) -> list[Any]:
    import time
    deadline = time.monotonic() + timeout
    collected: dict[int, Any] = {}
    while len(collected) < len(processes):
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue.Empty:
            dead = [p for p in processes if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"{name}: rank {processes.index(dead[0])} exited with code {dead[0].exitcode} "
                                   f"before returning a result")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} did not finish within {timeout:.0f} s "
                                   f"({len(collected)}/{len(processes)} ranks done)")
            continue
        if not ok:
            raise RuntimeError(f"{name}: rank {rank} failed:\n{value}")
        collected[rank] = value
    return [collected[rank] for rank in range(len(processes))]
