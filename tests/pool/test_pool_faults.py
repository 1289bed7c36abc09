"""Faults: a worker killed mid-call, exceptions inside workers (all ranks or one), a worker that died while idle."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from sp_runtime.pool import RemoteError, WorkerError
from pool_kit import alive, assert_matches, call_toy, open_pool, reference, toy_checkpoint, toy_inputs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return toy_checkpoint(tmp_path_factory.mktemp("toy"))


@pytest.fixture(scope="module")
def pool():
    with open_pool(2, error_grace_s=1.0) as pool:
        yield pool


def assert_works(pool, checkpoint):
    out, inputs = call_toy(pool.load_model(checkpoint), seed=11)
    assert_matches(out, reference(checkpoint)(**inputs))
    assert pool.state == "idle"


def test_sigkill_during_call_raises_quickly_then_recovers(pool, checkpoint):
    model = pool.load_model(checkpoint)
    victim = pool.worker_pids[1]
    killer = threading.Timer(0.5, os.kill, (victim, signal.SIGKILL))
    killer.start()
    started = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 on cpu .*SIGKILL") as caught:
        call_toy(model, toy_sleep=5.0)
    assert time.monotonic() - started < 4.0  # the call would take 10 s: the death was noticed, not waited out
    killer.join()
    assert caught.value.rank == 1 and pool.state == "broken"
    assert alive([victim]) == []
    assert_works(pool, checkpoint)  # restarts and reloads the model transparently
    assert pool.restarts == 1 and victim not in pool.worker_pids


def test_exception_on_every_rank_keeps_the_pool(pool, checkpoint):
    model = pool.load_model(checkpoint)
    pids, restarts = pool.worker_pids, pool.restarts
    with pytest.raises(RemoteError, match="toy failure injected on every rank") as caught:
        call_toy(model, toy_fail_rank=-1)
    assert caught.value.error_type == "ValueError" and "toy.py" in caught.value.remote_traceback
    assert pool.state == "idle" and pool.worker_pids == pids
    assert_works(pool, checkpoint)
    assert pool.restarts == restarts


def test_bad_shape_caught_in_the_worker_keeps_the_pool(pool, checkpoint):
    model = pool.load_model(checkpoint)
    pids = pool.worker_pids
    inputs = toy_inputs(size=(9, 14))  # passes the host's checks; the toy needs multiples of its patch size
    with pytest.raises(RemoteError, match="multiples of the patch size"):
        model(inputs["x"], inputs["timestep"], context=inputs["context"], y=inputs["y"])
    assert pool.worker_pids == pids
    assert_works(pool, checkpoint)


def test_exception_on_one_rank_restarts_the_pool(pool, checkpoint):
    model = pool.load_model(checkpoint)
    pids, restarts = pool.worker_pids, pool.restarts
    with pytest.raises(RemoteError, match=r"rank 1 .*toy failure injected on rank 1") as caught:
        call_toy(model, toy_fail_rank=1)
    assert caught.value.rank == 1 and "restarts" in str(caught.value)
    assert alive(pids) == []  # rank 0 was stuck in a collective: killed
    assert_works(pool, checkpoint)
    assert pool.restarts == restarts + 1


def test_worker_dead_while_idle_is_replaced_before_the_next_call(pool, checkpoint):
    pool.load_model(checkpoint)
    victim = pool.worker_pids[0]
    events = []
    pool.add_listener(events.append)
    try:
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 5
        # until the kernel lets it be reaped (a killed process shows as a zombie a moment before that)
        while pool.status()["ranks"][0]["alive"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "SIGKILL" in pool.status()["ranks"][0]["exit_cause"]  # the panel's "failed" text
        assert_works(pool, checkpoint)
    finally:
        pool.remove_listener(events.append)
    assert victim not in pool.worker_pids
    died = [event for event in events if event["event"] == "worker_died"]
    assert died and died[0]["rank"] == 0 and "SIGKILL" in died[0]["cause"]
    assert pool.status()["last_error"]["kind"] == "WorkerDied"
