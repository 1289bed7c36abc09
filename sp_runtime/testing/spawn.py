"""run_distributed: run a function on N spawned gloo ranks (for tests and benchmarks) and collect the results.

Every child is killed and reaped when one fails, when the time runs out, or when the caller is interrupted.
"""
from __future__ import annotations

import os
import queue
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

_CHILD_EXIT_GRACE_S = 5.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


def _child(rank: int, world_size: int, port: int, threads: int, results, fn: Callable, args: tuple) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
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
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_child, args=(rank, world_size, port, threads, results, fn, args),
                                 daemon=True) for rank in range(world_size)]
    try:
        for process in processes:
            process.start()
        return _collect(results, processes, world_size, timeout)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(_CHILD_EXIT_GRACE_S)
        results.close()


def _collect(results, processes, world_size: int, timeout: float) -> list[Any]:
    import time
    deadline = time.monotonic() + timeout
    collected: dict[int, Any] = {}
    while len(collected) < world_size:
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue.Empty:
            dead = [p for p in processes if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"rank {processes.index(dead[0])} exited with code {dead[0].exitcode} "
                                   f"before returning a result")
            if time.monotonic() > deadline:
                raise TimeoutError(f"distributed run did not finish in {timeout:.0f} s "
                                   f"({len(collected)}/{world_size} ranks done)")
            continue
        if not ok:
            raise RuntimeError(f"rank {rank} failed:\n{value}")
        collected[rank] = _from_bytes(value)
    return [collected[rank] for rank in range(world_size)]
