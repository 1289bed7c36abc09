"""Cancel: a call stops within one block on every rank, the pool stays usable, and stuck workers are replaced."""
from __future__ import annotations

import time

import pytest

from sp_runtime import Cancelled
from sp_runtime.pool.requests import CPU_WINDOW_S
from pool_kit import assert_matches, open_pool, reference, toy_checkpoint, toy_inputs

BLOCK_S = 1.0  # toy_sleep per block; the toy has 3 blocks, so a full call takes > 3 s


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return toy_checkpoint(tmp_path_factory.mktemp("toy"), depth=3)


@pytest.fixture(scope="module")
def pool():
    with open_pool(2, cancel_grace_s=1.5) as pool:
        yield pool


def after(seconds: float):
    start = time.monotonic()
    return lambda: time.monotonic() - start > seconds


def run(model, seed=0, **extra):
    inputs = toy_inputs(seed=seed)
    return model(inputs["x"], inputs["timestep"], context=inputs["context"], y=inputs["y"], **extra), inputs


def test_cancel_mid_call_stops_within_a_block(pool, checkpoint):
    model = pool.load_model(checkpoint)
    pids = pool.worker_pids
    started = time.monotonic()
    with pytest.raises(Cancelled):
        run(model, toy_sleep=BLOCK_S, should_cancel=after(0.3))
    elapsed = time.monotonic() - started
    assert elapsed < 2 * BLOCK_S + 0.5, f"cancel took {elapsed:.1f} s"  # the call itself takes > 3 s
    status = pool.status()
    assert pool.worker_pids == pids and status["state"] == "idle" and pool.restarts == 0
    assert {rank["blocks_done"] for rank in status["ranks"]} == {2}  # all ranks stopped at the same block
    out, inputs = run(model, seed=4)
    assert_matches(out, reference(checkpoint)(**inputs))


def test_cancel_before_the_call_sends_nothing(pool, checkpoint):
    model = pool.load_model(checkpoint)
    calls = pool.stats["calls"]
    with pytest.raises(Cancelled):
        run(model, should_cancel=lambda: True)
    assert pool.stats["calls"] == calls and pool.state == "idle"


def test_workers_that_do_not_stop_are_replaced(pool, checkpoint):
    model = pool.load_model(checkpoint)
    pids = pool.worker_pids
    started = time.monotonic()
    with pytest.raises(Cancelled):
        run(model, toy_sleep=30.0, should_cancel=after(0.2))  # stuck inside a block
    assert time.monotonic() - started < 1.5 + 2.0 + CPU_WINDOW_S  # (its CPU time shows it idle a window later)
    assert pool.state == "broken"
    out, inputs = run(model, seed=5)
    assert_matches(out, reference(checkpoint)(**inputs))
    assert set(pool.worker_pids).isdisjoint(pids) and pool.restarts == 1


def test_a_block_slower_than_the_grace_finishes_instead_of_a_restart(pool, checkpoint):
    """Blocks of 2.5 s (longer than the 1.5 s grace): the grace grows with the measured block time."""
    model = pool.load_model(checkpoint)
    pids, restarts = pool.worker_pids, pool.restarts
    with pytest.raises(Cancelled):
        run(model, toy_sleep=2.5, should_cancel=after(2.8))  # early in the second block
    assert pool.worker_pids == pids and pool.restarts == restarts and pool.state == "idle"
    assert {rank["blocks_done"] for rank in pool.status()["ranks"]} == {3}  # stopped at the next block check


def test_cancel_during_a_first_call_whose_block_computes_longer_than_the_grace_stops_after_the_block(pool, checkpoint):
    """A block that computes for 2.5 s (longer than the 1.5 s grace) in a call with no block time measured yet:
    the workers are busy, not stuck, so the pool waits for the next block check instead of restarting."""
    model = pool.load_model(checkpoint)
    pids, restarts = pool.worker_pids, pool.restarts
    pool._exchange.block_s = 0.0  # as in the first call of a model: no block time measured yet
    with pytest.raises(Cancelled):
        run(model, toy_busy=2.5, should_cancel=after(0.3))
    assert pool.worker_pids == pids and pool.restarts == restarts and pool.state == "idle"
    assert {rank["blocks_done"] for rank in pool.status()["ranks"]} == {2}  # stopped at the next block check


class CallbackFailed(Exception):
    pass


def test_a_cancel_callback_that_raises_stops_the_call_without_a_restart(pool, checkpoint):
    model = pool.load_model(checkpoint)
    pids, restarts = pool.worker_pids, pool.restarts
    started = time.monotonic()

    def broken_callback():
        if time.monotonic() - started > 0.3:
            raise CallbackFailed("the host's cancel check failed")
        return False
    with pytest.raises(CallbackFailed):
        run(model, toy_sleep=BLOCK_S, should_cancel=broken_callback)
    assert pool.worker_pids == pids and pool.restarts == restarts and pool.state == "idle"
    out, inputs = run(model, seed=6)
    assert_matches(out, reference(checkpoint)(**inputs))
