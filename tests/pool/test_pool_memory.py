"""Memory: 200 calls leave the host's and the workers' resident memory flat (no per-call leak)."""
from __future__ import annotations

import psutil
import torch

from pool_kit import open_pool, toy_checkpoint, toy_inputs

WARMUP_CALLS, CALLS = 30, 200
SIZE = 48
MAX_GROWTH = 8 * 2 ** 20  # bytes over 200 calls; keeping one latent (72 KiB) per call would add 14 MiB


def rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def test_200_calls_keep_rss_flat(tmp_path):
    checkpoint = toy_checkpoint(tmp_path, depth=1)
    with open_pool(2) as pool:
        model = pool.load_model(checkpoint)
        context = toy_inputs()["context"]
        generator = torch.Generator().manual_seed(0)

        def step():
            x = torch.randn(2, 4, SIZE, SIZE, generator=generator)
            out = model(x, torch.rand(2, generator=generator), context=torch.cat([context[:1], context[1:]]),
                        y=torch.zeros(2, 6), ref_latents=[x[:, :, :4, :4]])
            assert out.shape == x.shape

        for _ in range(WARMUP_CALLS):
            step()
        before = [rss(pid) for pid in (psutil.Process().pid, *pool.worker_pids)]
        for _ in range(CALLS):
            step()
        after = [rss(pid) for pid in (psutil.Process().pid, *pool.worker_pids)]
        growth = [b - a for a, b in zip(before, after)]
        assert pool.restarts == 0 and pool.stats["calls"] == WARMUP_CALLS + CALLS
    assert max(growth) < MAX_GROWTH, f"RSS growth over {CALLS} calls (host, workers): {growth}"
    print(f"RSS growth over {CALLS} calls (host, workers) in bytes: {growth}")
