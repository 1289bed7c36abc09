"""Hung ranks: a worker stopped (SIGSTOP) during a call or a load fails it within the watchdog time, naming that
rank, and the pool restarts cleanly; a rank wedged before a collective while its heartbeat goes on is found by the
progress (stall) watchdog long before the collective timeout."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time

import pytest

from sp_runtime.pool import WorkerError
from pool_kit import alive, assert_matches, open_pool, reference, toy_checkpoint, toy_inputs

WATCHDOG_S = 1.5
STALL_S = 2.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return toy_checkpoint(tmp_path_factory.mktemp("toy"))


@pytest.fixture(scope="module")
def pool():
    with open_pool(2, watchdog_s=WATCHDOG_S) as pool:
        yield pool


def call(model, seed=0, **extra):
    inputs = toy_inputs(seed=seed)
    return model(inputs["x"], inputs["timestep"], context=inputs["context"], y=inputs["y"], **extra), inputs


@contextlib.contextmanager
def stopped_later(pid: int, delay_s: float):
    """SIGSTOP pid after delay_s; afterwards SIGCONT it (if the pool has not killed it) so nothing stays stopped."""
    timer = threading.Timer(delay_s, os.kill, (pid, signal.SIGSTOP))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()
        if alive([pid]):
            os.kill(pid, signal.SIGCONT)


def assert_restarts_cleanly(pool, checkpoint, old_pids):
    out, inputs = call(pool.load_model(checkpoint), seed=3)
    assert_matches(out, reference(checkpoint)(**inputs))
    assert set(pool.worker_pids).isdisjoint(old_pids) and alive(old_pids) == []


def test_rank_stopped_during_a_call_is_named_within_the_watchdog(pool, checkpoint):
    model = pool.load_model(checkpoint)
    pids, restarts = pool.worker_pids, pool.restarts
    started = time.monotonic()
    with stopped_later(pids[1], 0.3), pytest.raises(WorkerError, match=r"rank 1 on cpu .*no progress") as caught:
        call(model, toy_sleep=1.0)  # 2 blocks of 1 s: rank 0 waits for rank 1 in a collective meanwhile
    elapsed = time.monotonic() - started
    assert caught.value.rank == 1
    assert elapsed < 0.3 + WATCHDOG_S + 2.0, f"the stopped rank was detected after {elapsed:.1f} s"
    assert pool.state == "broken"
    assert_restarts_cleanly(pool, checkpoint, pids)
    assert pool.restarts == restarts + 1


def test_rank_stopped_during_a_load_fails_the_load_naming_it(pool, checkpoint):
    pool.unload_all()
    pids = pool.worker_pids
    started = time.monotonic()
    with stopped_later(pids[0], 0.0), pytest.raises(WorkerError, match=r"rank 0 on cpu .*no progress for .* during load"):
        time.sleep(0.1)
        pool.load_model(checkpoint)
    assert time.monotonic() - started < WATCHDOG_S + 2.5
    assert_restarts_cleanly(pool, checkpoint, pids)



def test_a_rank_wedged_before_a_collective_is_found_by_the_stall_watchdog(pool, checkpoint):
    """Rank 1 sleeps inside a block (its heartbeat goes on) while rank 0 waits for it in the next all-to-all: no
    block passes and no rank computes, so the call fails after stall_s, not after the 300 s collective timeout."""
    timeouts = dataclasses.replace(pool.timeouts)
    pool.timeouts.stall_s, pool.timeouts.watchdog_s = STALL_S, 20.0  # heartbeats go on: only the stall counts
    try:
        model = pool.load_model(checkpoint)
        pids, restarts = pool.worker_pids, pool.restarts
        pool._exchange.block_s = 0.0  # the limit grows with the slowest block measured: none here
        started = time.monotonic()
        with pytest.raises(WorkerError, match=r"no progress for .* during call .*stall_s") as caught:
            call(model, toy_sleep=10.0, toy_sleep_rank=1)
        elapsed = time.monotonic() - started
        assert elapsed < STALL_S + 2.5, f"the wedge was found after {elapsed:.1f} s"
        assert "blocks passed per rank" in str(caught.value)
        assert pool.state == "broken"
        assert_restarts_cleanly(pool, checkpoint, pids)
        assert pool.restarts == restarts + 1
    finally:
        pool.timeouts.stall_s, pool.timeouts.watchdog_s = timeouts.stall_s, timeouts.watchdog_s
