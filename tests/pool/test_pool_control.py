"""Control operations never wait behind a long load: a model load or LoRA change stops at its next tensor when the
caller cancels it, when the panel's Unload or Shut down is pressed, or when the pool closes; the weights stay as
they were and the pool stays usable. Slow loads are made with the worker's test hook (a sleep per progress step)."""
from __future__ import annotations

import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from comfy_support import import_node_module
from sp_runtime import Cancelled, SPConfig, WorkerPool
from sp_runtime.pool import PoolClosedError
from sp_runtime.pool import pool as pool_module
from sp_lab.tiny_models import write_tiny_checkpoint
from pool_kit import toy_checkpoint

# every progress step of the workers' loads (or LoRA changes) sleeps this long: the toy below has 40 tensors, so its
# load takes 20 s; the bounds leave room for a loaded machine (closing a pool's idle workers alone takes up to 5 s on
# 2 busy cores)
SLOW_LOADS = {"ULYSSES_SP_TEST_SLOW_PROGRESS": "load=0.5"}
SLOW_LORAS = {"ULYSSES_SP_TEST_SLOW_PROGRESS": "set_loras=0.5"}
owner_module = import_node_module("pool_owner")
model_spec = import_node_module("model_spec")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("control")
    qwen = write_tiny_checkpoint("qwen_image", str(folder / "qwen.safetensors"), seed=2)
    g = torch.Generator().manual_seed(3)
    lora = str(folder / "lora.safetensors")
    save_file({f"transformer_blocks.{b}.attn.to_{p}.lora_{s}.weight": torch.randn(*shape, generator=g)
               for b in (0, 1) for p in "qkv" for s, shape in (("A", (4, 96)), ("B", (96, 4)))}, lora)
    return {"toy": toy_checkpoint(folder, depth=4), "qwen": qwen, "lora": lora}


@pytest.fixture(scope="module")
def slow_pool():
    """Loads are slow here; the module's last test closes it through the panel's Shut down."""
    pool = WorkerPool(SPConfig(["cpu"] * 2), env=SLOW_LOADS)
    try:
        yield pool
    finally:
        pool.close()


def in_thread(function, *args, **kwargs):
    """Run function in a thread; returns (thread, outcome list that gets its result or exception)."""
    outcome = []

    def target():
        try:
            outcome.append(function(*args, **kwargs))
        except BaseException as error:  # noqa: BLE001 - examined by the test
            outcome.append(error)
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


def interrupting(control, bound_s: float, load, *args):
    """Start load(*args) in a thread; a second later control() must return within bound_s, and the load end.
    Returns (control's result, the load's result or exception)."""
    thread, outcome = in_thread(load, *args)
    time.sleep(1.0)
    started = time.monotonic()
    result = control()
    assert time.monotonic() - started < bound_s
    thread.join(10)
    assert not thread.is_alive()
    return result, outcome[0]


def after(seconds: float):
    start = time.monotonic()
    return lambda: time.monotonic() - start > seconds


def test_a_slow_lora_change_is_cancelled_unchanged_and_close_does_not_wait_for_one(files, monkeypatch):
    monkeypatch.setattr(pool_module, "CLOSE_WAIT_S", 60.0)  # close stops the change: it never needs its time-out
    pool = WorkerPool(SPConfig(["cpu"] * 2), env=SLOW_LORAS)
    try:
        handle = pool.load_model(files["qwen"], "fp32")
        g = torch.Generator().manual_seed(1)
        x, t = torch.randn(1, 16, 1, 6, 4, generator=g), torch.tensor([0.5])
        context = torch.randn(1, 5, 32, generator=g)
        plain = handle(x, t, context=context)
        pids = pool.worker_pids
        started = time.monotonic()
        with pytest.raises(Cancelled):
            pool.set_loras(handle, [[files["lora"], 1.0]], should_cancel=after(0.6))  # 6 adapters, 6 weights
        assert time.monotonic() - started < 0.6 + 3.0
        assert pool.worker_pids == pids and pool.state == "idle" and handle.loras == ()
        assert torch.equal(handle(x, t, context=context), plain)

        _, outcome = interrupting(pool.close, 12.0, pool.set_loras, handle, [[files["lora"], 1.0]])
        assert isinstance(outcome, (Cancelled, PoolClosedError))
    finally:
        pool.close()


def test_a_slow_load_is_cancelled_and_loads_nothing(slow_pool, files):
    started = time.monotonic()
    with pytest.raises(Cancelled):
        slow_pool.load_model(files["toy"], should_cancel=after(0.6))
    assert time.monotonic() - started < 8.0  # the whole load: 20 s (a first load also imports its family first)
    assert not any(model["path"] == files["toy"] for model in slow_pool.status()["models"])
    assert slow_pool.state == "idle"


def test_unload_all_does_not_wait_behind_a_slow_load(slow_pool, files):
    _, outcome = interrupting(slow_pool.unload_all, 5.0, slow_pool.load_model, files["toy"])
    assert isinstance(outcome, Cancelled)
    assert slow_pool.state == "idle" and slow_pool.status()["models"] == []


def test_the_panels_unload_and_shutdown_do_not_wait_behind_a_loader(slow_pool, files, monkeypatch):
    monkeypatch.setattr(pool_module, "CLOSE_WAIT_S", 60.0)
    owner = owner_module.PoolOwner(lambda config: slow_pool)
    spec = model_spec.ModelSpec.create(SPConfig(["cpu"] * 2), files["toy"])
    try:
        owner.pool_for(spec.config)
        _, outcome = interrupting(owner.unload_all, 5.0, owner.load, spec)
        assert isinstance(outcome, Cancelled)
        closed, outcome = interrupting(owner.shutdown, 12.0, owner.load, spec)
        assert closed == 1 and isinstance(outcome, (Cancelled, PoolClosedError)) and owner.pool_count == 0
    finally:
        owner.close_all()
