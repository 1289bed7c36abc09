"""Pool lifecycle: start, status, many calls on one pool, load cache and progress, unload, close leaves nothing."""
from __future__ import annotations

import json
import os
import sys

import psutil
import pytest
import torch

from sp_runtime import SPConfig
from sp_runtime.pool import ModelHandle, PoolClosedError, PoolStartError, WorkerPool
from pool_kit import alive, assert_matches, open_pool, reference, toy_checkpoint, toy_inputs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return toy_checkpoint(tmp_path_factory.mktemp("toy"))


@pytest.fixture(scope="module")
def pool():
    with open_pool(2) as pool:
        yield pool


def test_start_and_status(pool):
    status = json.loads(json.dumps(pool.status()))  # JSON-ready
    assert status["state"] == "idle" and status["layout"] == "u2" and status["backend"] == "gloo"
    assert [rank["device"] for rank in status["ranks"]] == ["cpu", "cpu"]
    assert [rank["pid"] for rank in status["ranks"]] == pool.worker_pids
    assert all(rank["alive"] and rank["memory"]["rss"] > 0 for rank in status["ranks"])
    if sys.platform.startswith("linux"):
        assert all(rank["memory"]["peak"] > 0 for rank in status["ranks"])  # peak RSS (VmHWM)
    assert all(rank["memory"]["rss"] < rank["memory"]["limit"] for rank in status["ranks"])
    assert [rank["coords"] for rank in status["ranks"]] == [{"cfg": 0, "ring": 0, "ulysses": 0, "tp": 0},
                                                            {"cfg": 0, "ring": 0, "ulysses": 1, "tp": 0}]
    assert status["last_error"] is None
    workers = {child.pid for child in psutil.Process().children()}
    assert set(pool.worker_pids) <= workers


def test_cpu_memory_limit_is_the_address_space_limit_when_one_is_set():
    import resource
    from sp_runtime.pool.status import rank_memory
    child = psutil.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (2 ** 33, 2 ** 33)))
    try:
        assert rank_memory("cpu", child.pid, {})["limit"] == 2 ** 33
        assert rank_memory("cpu", os.getpid(), {})["limit_kind"] == "machine memory"
    finally:
        child.kill()
        child.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS is Linux's VmHWM")
def test_cpu_memory_has_a_peak_rss_that_outlives_freed_memory():
    from sp_runtime.pool.status import rank_memory
    block = torch.ones(2 ** 24)  # 64 MiB, resident while it lives, returned to the system when freed
    during = rank_memory("cpu", os.getpid(), {})
    del block
    after = rank_memory("cpu", os.getpid(), {})
    assert during["rss"] > 2 ** 26 and during["peak"] > 2 ** 26
    # the kernel's counters are per-CPU approximations (peak and RSS may differ by a few pages), so compare
    # with half the freed block: the peak keeps it, the RSS does not
    assert after["peak"] > after["rss"] + 2 ** 25
    assert rank_memory("cpu", None, {}) == {}
    assert rank_memory("cuda:0", 1, {"peak": 5, "allocated": 3}) == {"peak": 5, "allocated": 3}  # as reported


def test_load_is_cached_and_reports_progress(pool, checkpoint):
    pool.unload_all()
    events, fractions = [], []
    pool.add_listener(events.append)
    try:
        first = pool.load_model(checkpoint, progress=lambda fraction, message: fractions.append(fraction))
        second = pool.load_model(checkpoint)
    finally:
        pool.remove_listener(events.append)
    assert isinstance(first, ModelHandle) and first.key == second.key and first.loaded
    assert first.info.family == "toy" and first.info.in_channels == 4 and first.info.x_ndim == 4
    assert fractions and fractions[-1] == 1.0
    loads = [event for event in events if event["event"] == "loaded"]
    assert len(loads) == 1  # the second load_model did not reach the workers
    assert any(model["key"] == first.key for model in pool.status()["models"])


def test_many_calls_on_one_pool(pool, checkpoint):
    model = pool.load_model(checkpoint)
    expected_model = reference(checkpoint)
    pids = pool.worker_pids
    calls = []
    pool.add_listener(lambda event: calls.append(event) if event["event"] == "call" else None)
    for step in range(12):
        inputs = toy_inputs(seed=step)
        out = model(inputs["x"], inputs["timestep"], context=inputs["context"], y=inputs["y"])
        assert out.device.type == "cpu"
        if step % 4 == 0:
            assert_matches(out, expected_model(**inputs))
    assert pool.worker_pids == pids and pool.restarts == 0
    assert len(calls) == 12 and all(call["seconds"] > 0 for call in calls)
    ranks = pool.status()["ranks"]
    assert all(rank["calls"] >= 12 and rank["last_call_s"] > 0 for rank in ranks)


def test_unload_then_call_reloads(pool, checkpoint):
    model = pool.load_model(checkpoint)
    pool.unload(model)
    assert not model.loaded and pool.status()["models"] == []
    inputs = toy_inputs(seed=3)
    out = model(inputs["x"], inputs["timestep"], context=inputs["context"], y=inputs["y"])
    assert model.loaded
    assert_matches(out, reference(checkpoint)(**inputs))
    pool.unload_all()
    assert not model.loaded


def test_close_leaves_no_process_and_no_segment(checkpoint):
    pool = WorkerPool(SPConfig(["cpu", "cpu"]))
    try:
        model = pool.load_model(checkpoint)
        inputs = toy_inputs()
        model(inputs["x"], inputs["timestep"], context=inputs["context"], y=inputs["y"])
        pids, segments, log_dir = pool.worker_pids, pool.segment_names(), pool.log_dir
        assert len(segments) == 3 and all(os.path.exists(f"/dev/shm/{name}") for name in segments)
    finally:
        pool.close()
    assert alive(pids) == []
    assert not set(pids) & {child.pid for child in psutil.Process().children(recursive=True)}
    assert [name for name in segments if os.path.exists(f"/dev/shm/{name}")] == []
    assert not os.path.exists(log_dir)
    pool.close()  # idempotent
    assert pool.state == "closed"
    with pytest.raises(PoolClosedError):
        model(inputs["x"], inputs["timestep"], context=inputs["context"], y=inputs["y"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_start_error_names_the_device():
    with pytest.raises(PoolStartError, match=r"cuda:0.*not available") as caught:
        WorkerPool(SPConfig(["cuda:0"]), start_timeout_s=60)
    assert caught.value.rank == 0 and caught.value.device == "cuda:0"


def test_deep_copies_of_a_handle_share_the_pool(pool, checkpoint):
    import copy
    model = pool.load_model(checkpoint)
    twin = copy.deepcopy({"model": model})["model"]
    assert twin is not model and twin._pool is pool and twin.key == model.key
    inputs = toy_inputs(seed=9)
    assert torch.equal(twin(inputs["x"], inputs["timestep"], context=inputs["context"], y=inputs["y"]).clone(),
                       model(inputs["x"], inputs["timestep"], context=inputs["context"], y=inputs["y"]))


def test_calls_keep_step_history_and_speedup_over_a_single_device_run(pool, checkpoint):
    from sp_runtime.pool.steps import STEPS
    model = pool.load_model(checkpoint)
    inputs = toy_inputs(seed=8)
    shape = tuple(inputs["x"].shape)
    model(inputs["x"], inputs["timestep"], context=inputs["context"], y=inputs["y"])
    step = pool.status()["last_step"]
    assert step["layout"] == "u2" and step["shape"] == list(shape) and step["world_size"] == 2
    assert step["speedup"] is None and step["seconds"] > 0  # no single-device time of this model and shape yet
    assert step["baseline_s"] is None and len(step["rank_seconds"]) == 2
    STEPS.record(model.key, shape, "1", 4 * step["seconds"])  # as a one-device pool of this process would
    model(inputs["x"], inputs["timestep"], context=inputs["context"], y=inputs["y"])
    assert pool.last_step["speedup"] > 0 and pool.status()["activity"] == "idle"
    assert pool.last_step["baseline_s"] == 4 * step["seconds"]  # the panel's dashed one-device line


def test_step_history_keeps_recent_times_and_compares_medians():
    from sp_runtime.pool.steps import STEP_HISTORY, StepHistory
    steps = StepHistory()
    for seconds in (1.0, 3.0, 2.0):
        steps.record("m", (1, 4), "1", seconds)
    assert steps.speedup("m", (1, 4), "u2") is None
    for seconds in [100.0] * STEP_HISTORY + [0.5, 1.5]:  # only the most recent STEP_HISTORY count
        steps.record("m", (1, 4), "u2", seconds)
    assert steps.speedup("m", (1, 4), "u2") == pytest.approx(2.0 / 100.0)
    assert steps.single_device("m", (1, 4)) == 2.0
    assert steps.speedup("m", (1, 8), "u2") is None  # another latent size is another comparison


def test_a_resident_model_is_found_without_reading_its_file(pool, checkpoint, monkeypatch):
    """The pool owner asks for its model at every step: that must not read the checkpoint's header each time."""
    from sp_runtime.checkpoints import header as header_module
    first = pool.load_model(checkpoint)
    monkeypatch.setattr(header_module, "read_header", lambda file: pytest.fail(f"the header of {file} was read"))
    assert pool.load_model(checkpoint).key == first.key
    pool.unload(first)
    with pytest.raises(pytest.fail.Exception):  # not resident any more: a real load reads it (once)
        pool.load_model(checkpoint)
