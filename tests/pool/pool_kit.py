"""Shared helpers for the pool tests (no tests here): toy checkpoints, pools that always close, inputs, tolerances."""
from __future__ import annotations

import contextlib
import os

import psutil
import torch

from sp_runtime import SPConfig
from sp_lab.families.toy import ToyReference, save_toy_checkpoint
from sp_runtime.pool import WorkerPool
from sp_runtime.pool.segments import our_segments

TOY = dict(in_channels=4, hidden=24, heads=3, depth=2, context_dim=8, y_dim=6, patch_size=2)


def toy_checkpoint(folder, name: str = "toy.safetensors", seed: int = 0, **config) -> str:
    path = os.path.join(str(folder), name)
    save_toy_checkpoint(path, seed=seed, **{**TOY, **config})
    return path


@contextlib.contextmanager
def open_pool(world: int, **options):
    """A CPU pool of `world` workers that is closed even when the test fails."""
    pool = WorkerPool(SPConfig(["cpu"] * world), **options)
    try:
        yield pool
    finally:
        pool.close()


def toy_inputs(seed: int = 0, batch: int = 2, channels: int = 4, size=(10, 14), frames=None,
               text: int = 5, context_dim: int = 8, y_dim: int = 6) -> dict:
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, channels) + ((frames,) if frames else ()) + tuple(size)
    return {"x": torch.randn(shape, generator=generator), "timestep": torch.rand(batch, generator=generator),
            "context": torch.randn(batch, text, context_dim, generator=generator),
            "y": torch.randn(batch, y_dim, generator=generator)}


def call_toy(model, seed: int = 0, **extra):
    """One call of a toy SP model on seeded inputs: (output, the inputs used)."""
    inputs = toy_inputs(seed=seed)
    return model(inputs["x"], inputs["timestep"], context=inputs["context"], y=inputs["y"], **extra), inputs


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5) -> None:
    """Max abs difference <= rel x output scale (max abs of the reference, at least 1)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    scale = max(1.0, expected.abs().max().item())
    diff = (actual.float() - expected.float()).abs().max().item()
    assert diff <= rel * scale, f"max abs diff {diff:.3g} > {rel:g} x scale {scale:.3g}"


def reference(path: str, dtype: str = "default") -> ToyReference:
    return ToyReference(path, dtype)


def alive(pids) -> list[int]:
    """PIDs that still run (zombies count as gone)."""
    running = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
        except psutil.NoSuchProcess:
            pass
    return running


def segments_of(pid: int) -> list[str]:
    return our_segments(pid)
