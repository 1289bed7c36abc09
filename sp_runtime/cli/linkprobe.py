"""Link measurements on the pool's devices: spawned ranks (NCCL on GPUs, gloo on CPUs) that time all-to-all
bandwidth by message size (doctor) and the exchanges of one denoising step with their real buffer sizes (bench).

The ranks join the same process-group layout as the workers (sp_runtime.groups.build_groups), so the exchanges
run over the same links; they are timed alone, so a time share built from them assumes no overlap with compute.
"""
from __future__ import annotations

import os
import traceback
from typing import Any, Callable, Optional, Sequence

from .machine import device_sync, median_time


def run_ranks(fn: Callable, devices: Sequence[str], *args: Any, timeout: float = 300.0,
              backend: Optional[str] = None) -> list[Any]:
    """Run fn(rank, devices, *args) in one spawned process per device, joined by a process group (NCCL on CUDA,
    or `backend`: gloo lets several ranks share one GPU).

    fn must be a module-level function returning picklable values. Raises RuntimeError with the failing rank's
    traceback, or TimeoutError; every child is ended either way.
    """
    from ..local_ranks import spawn_ranks
    threads = max(1, (os.cpu_count() or 1) // len(devices))
    return spawn_ranks(_child, len(devices), (list(devices), threads, fn, args, backend), timeout, "link probe")


def _child(rank: int, store_path: str, results, devices: list[str], threads: int, fn: Callable, args: tuple,
           backend: Optional[str]) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from ..local_ranks import join_process_group
    try:
        torch.set_num_threads(threads)
        device = torch.device(devices[rank])
        options = {}
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        if backend == "nccl":
            options["device_id"] = device
        join_process_group(backend, store_path, rank, len(devices), timeout=datetime.timedelta(seconds=120),
                           **options)
        try:
            results.put((rank, True, fn(rank, devices, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which ends the other ranks
        results.put((rank, False, traceback.format_exc()))


# ---- timing inside the ranks -------------------------------------------------------------------------------------
def _timed(fn: Callable[[], None], device, repeats: int, group=None) -> float:
    """Median seconds of fn() after one warm-up; ranks start each repeat together (barrier)."""
    import torch.distributed as dist
    return median_time(fn, repeats, lambda: dist.barrier(group=group), sync=device_sync(device))


def all_to_all_sweep(rank: int, devices: list[str], sizes: Sequence[int], repeats: int) -> list[dict]:
    """all_to_all_single over every rank, per message size (bytes each rank sends in total, self share included)."""
    import torch
    import torch.distributed as dist
    device = torch.device(devices[rank])
    world = len(devices)
    rows = []
    for size in sizes:
        elements = max(world, size // 4 // world * world)
        send = torch.ones(elements, dtype=torch.float32, device=device)
        received = torch.empty_like(send)
        seconds = _timed(lambda: dist.all_to_all_single(received, send), device, repeats)
        rows.append({"bytes": elements * 4, "seconds": seconds})
    return rows


def exchange_times(rank: int, devices: list[str], config: dict, batch: int, exchanges: list[dict],
                   dtype: str, repeats: int) -> list[float]:
    """Median seconds of one call of each exchange (comm.Exchange as dict), on this layout's real groups."""
    import torch
    import torch.distributed as dist

    from ..config import SPConfig
    from ..groups import build_groups
    from .comm import sequence_layout
    device = torch.device(devices[rank])
    layout = SPConfig(**config)
    groups = build_groups(layout)
    split_by_cfg = sequence_layout(layout, batch)[1] == layout.ring_degree
    seq = groups.seq if split_by_cfg else groups.seq_all
    torch_dtype = getattr(torch, dtype)
    times = []
    for exchange in exchanges:
        send = torch.ones(exchange["elements"], dtype=torch_dtype, device=device)
        received = torch.empty_like(send)
        if exchange["kind"] == "all_to_all":
            def call(send=send, received=received):
                dist.all_to_all_single(received, send, group=seq.ulysses_group)
            group = seq.ulysses_group
        elif exchange["kind"] == "ring_shift":
            ranks, position, degree = seq.ring_global_ranks, seq.ring_rank, seq.ring_degree

            def call(send=send, received=received, ranks=ranks, position=position, degree=degree):
                for request in dist.batch_isend_irecv([
                        dist.P2POp(dist.isend, send, ranks[(position + 1) % degree], seq.ring_group),
                        dist.P2POp(dist.irecv, received, ranks[(position - 1) % degree], seq.ring_group)]):
                    request.wait()
            group = seq.ring_group
        else:
            gathered = torch.empty(exchange["elements"] * seq.ring_degree, dtype=torch_dtype, device=device)
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

            def call(send=send, gathered=gathered):
                gather(gathered, send, group=seq.ring_group)
            group = seq.ring_group
        times.append(_timed(call, device, repeats, group))
    return times
