"""CPU workers share one copy of a model's weights (shared-memory chunks every rank maps) instead of a private copy
each: after a load, the workers' private memory (USS) grows by much less than the weights, the outputs are the
reference's, and nothing is left in /dev/shm once the pool closes."""
from __future__ import annotations

import os

import psutil
import pytest

from sp_runtime.pool.segments import SHM_DIR, our_segments
from pool_kit import assert_matches, call_toy, open_pool, reference, toy_checkpoint

LINUX_SHM = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm")
BIG = dict(hidden=384, heads=6, depth=3)  # 24 x 384^2 x 4 bytes per block: 42 MB of weights


def private_bytes(pids) -> list[int]:
    return [psutil.Process(pid).memory_full_info().uss for pid in pids]


@LINUX_SHM
def test_cpu_workers_share_the_weights(tmp_path):
    checkpoint = toy_checkpoint(tmp_path, **BIG)
    weights = os.path.getsize(checkpoint)
    with open_pool(2) as pool:
        pool.load_model(toy_checkpoint(tmp_path, "small.safetensors")).unload()  # the loaders' imports come first
        before = private_bytes(pool.worker_pids)
        model = pool.load_model(checkpoint)
        grown = [after - first for after, first in zip(private_bytes(pool.worker_pids), before)]
        assert all(growth < weights / 2 for growth in grown), (grown, weights)  # a private copy each: > weights
        shared = [sum(m.pss for m in psutil.Process(pid).memory_maps() if "_w" in os.path.basename(m.path))
                  for pid in pool.worker_pids]
        assert sum(shared) >= 0.9 * weights, (shared, weights)  # the weights, counted once over the workers
        out, inputs = call_toy(model)
        assert_matches(out, reference(checkpoint)(**inputs))
        assert not [name for name in our_segments(os.getpid()) if "_w" in name]  # names gone once loaded
