"""Shared helpers of the model-family tests (test_detect, test_qwen_image, test_flux): tolerances, comparisons,
a CallContext stand-in for in-process sequence-parallel runs without the pool, and at_worlds to pick the shared
plain pools of tests/family_pools.py by size."""
from __future__ import annotations

import pytest
import torch

# Parity tolerances, relative to the output scale (max |reference|, at least 1).
FP32_TOL = 1e-5
BF16_TOL = 8 * 2 ** -8   # bf16 compute (also fp8 storage): 8 units of bf16 rounding
# fp16 compute: 16 units of fp16 rounding. fp16 keeps 3 more mantissa bits than bf16 but the error is measured
# against the output scale while rounding happens on activations several times larger (residual growth).
FP16_TOL = 16 * 2 ** -11
TOLERANCE = {"float32": FP32_TOL, "bfloat16": BF16_TOL, "float8_e4m3fn": BF16_TOL, "float8_e5m2": BF16_TOL,
             "float16": FP16_TOL}


def relative_error(got: torch.Tensor, reference: torch.Tensor) -> float:
    """max |got - reference| / max(1, max |reference|); fails on shape or dtype mismatch and on NaN."""
    assert got.shape == reference.shape, (tuple(got.shape), tuple(reference.shape))
    assert got.dtype == reference.dtype, (got.dtype, reference.dtype)
    assert not got.isnan().any(), "the output has NaNs (a part of it was never written?)"
    scale = max(1.0, reference.abs().max().item())
    return (got.float() - reference.float()).abs().max().item() / scale


def at_worlds(*worlds: int):
    """Runs a test on family_pools' shared plain pools of these sizes only (indirect parametrization)."""
    return pytest.mark.parametrize("family_pool", list(worlds), indirect=True, ids=[f"world{w}" for w in worlds])


PARITY_LOG: list[tuple[str, str, float]] = []  # (what, dtype, relative error); family_pools prints a summary


def assert_parity(got: torch.Tensor, reference: torch.Tensor, dtype: str, what: str = "") -> float:
    error = relative_error(got, reference)
    PARITY_LOG.append((what, dtype, error))
    assert error <= TOLERANCE[dtype], f"{what}: relative error {error:.3e} > {TOLERANCE[dtype]:.1e} ({dtype})"
    return error


class LocalContext:
    """CallContext stand-in for sequence-parallel runs under sp_runtime.local_ranks (no pool)."""

    def __init__(self, groups, device: str = "cpu"):
        self.device = torch.device(device)
        self.groups = groups
        self.cancel_checks = 0

    def to_device(self, name, tensor, dtype=None):
        return tensor.to(self.device, dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype)

    def check_cancel(self):
        self.cancel_checks += 1


def run_family_cases(rank: int, world: int, layout: dict, loads: list) -> list:
    """Spawned rank: load each (path, dtype) and run its cases; returns per-load lists of this rank's `out`s.

    Each out starts as NaN, so the parent can check that every element was written by exactly one rank.
    layout: SPConfig keyword arguments besides devices (e.g. {"cfg_degree": 2}); calls go through the pool
    worker's run_forward, which splits CFG batches.
    """
    from sp_runtime.cfg_parallel import run_forward
    from sp_runtime.config import SPConfig
    from sp_runtime.pool.loading import load_worker_model
    from sp_runtime.contract import LoadRequest
    from sp_runtime.groups import build_groups
    groups = build_groups(SPConfig(["cpu"] * world, **layout))
    context = LocalContext(groups)
    results = []
    for path, dtype, cases in loads:
        model = load_worker_model(LoadRequest(path, dtype), torch.device("cpu"), groups, lambda *_: None)
        outs = []
        for x, timestep, inputs in cases:
            out = torch.full(model.info.output_shape(tuple(x.shape)), float("nan"), dtype=x.dtype)
            with torch.no_grad():
                run_forward(model, x, timestep, inputs, out, context)
            outs.append(out)
        results.append(outs)
    return results


def merge_rank_outputs(parts: list[torch.Tensor]) -> torch.Tensor:
    """Combine the ranks' outs: every element written by exactly one rank."""
    stack = torch.stack(parts)
    writers = (~stack.isnan()).sum(0)
    assert bool((writers == 1).all()), f"elements written by {sorted(writers.unique().tolist())} ranks, not 1"
    return torch.nansum(stack, 0).to(parts[0].dtype)


def single_rank_worker(path: str, options=None):
    """(the family's worker model loaded from `path` on one CPU rank, a LocalContext for its forward): for checks of
    input validation and cancellation without a pool."""
    from sp_runtime.config import SPConfig
    from sp_runtime.contract import LoadRequest
    from sp_runtime.groups import ParallelGroups, SeqParallel
    from sp_runtime.pool.loading import load_worker_model
    groups = ParallelGroups(SPConfig(["cpu"]), 0, SeqParallel.single(), None, 0, None)
    worker = load_worker_model(LoadRequest(path, options=options or {}), torch.device("cpu"), groups, lambda *_: None)
    return worker, LocalContext(groups)


def single_rank_output(worker, x: torch.Tensor, t: torch.Tensor, inputs: dict) -> torch.Tensor:
    """The output of one call of a single_rank_worker (x's shape)."""
    model, context = worker
    out = torch.empty(x.shape)
    model.forward(x, t, inputs, out, context)
    return out
