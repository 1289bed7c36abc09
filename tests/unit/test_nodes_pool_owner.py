"""The pool owner (nodes/pool_owner.py): one pool per device set, reuse, layout changes, the spec's LoRAs passed on,
events and status; against a fake pool so it needs neither ComfyUI nor worker processes."""
import json

import pytest
import torch

from comfy_support import import_node_module
from sp_runtime.config import config_from_inputs

owner_module = import_node_module("pool_owner")
model_spec = import_node_module("model_spec")


class FakeHandle:
    def __init__(self, pool, path, dtype, options):
        self.pool, self.path, self.dtype, self.options = pool, path, dtype, options
        self.calls = []

    def __call__(self, x, timestep, context=None, should_cancel=None, **extra):
        self.calls.append((x.shape, extra))
        return x * 2


class FakePool:
    """What the owner uses of WorkerPool; model caching, LoRA state and step times are the pool's own (tested in
    test_pool_lifecycle, test_lora and test_pool_steps)."""

    def __init__(self, config):
        self.config = config
        self.handles, self.lora_calls, self.listeners = {}, [], []
        self.closed = False
        self.unloads = self.loads = 0

    def load_model(self, path, dtype="default", progress=None, should_cancel=None, **options):
        self.loads += 1
        if progress:
            progress(1.0, "loaded")
        return self.handles.setdefault((path, dtype), FakeHandle(self, path, dtype, options))

    def set_loras(self, handle, loras, progress=None, patches=None, should_cancel=None):
        self.lora_calls.append((handle, loras) if patches is None else (handle, loras, patches))

    def unload_all(self):
        count, self.handles = len(self.handles), {}
        self.unloads += 1
        return count

    def close(self):
        self.closed = True

    def status(self):
        return {"state": "idle", "activity": "idle", "last_step": None,
                "models": [{"path": path, "dtype": dtype, "options": {}, "loras": []} for path, dtype in self.handles],
                "ranks": [{"rank": r, "device": d} for r, d in enumerate(self.config.devices)]}

    def add_listener(self, listener):
        self.listeners.append(listener)

    def emit(self, event):
        for listener in self.listeners:
            listener(event)


@pytest.fixture
def owner():
    pools = []

    def factory(config):
        pools.append(FakePool(config))
        return pools[-1]
    created = owner_module.PoolOwner(factory)
    created.pools = pools
    events = []
    created.add_listener(lambda event, data: events.append((event, data)))
    created.events = events
    yield created
    created.close_all()


def spec_for(text, path="/models/a.safetensors", cuda=4, **degrees):
    return model_spec.ModelSpec.create(config_from_inputs(text, cuda_count=cuda, **degrees), path)


def test_one_pool_per_device_set_reused_across_models_and_prompts(owner):
    first = owner.load(spec_for("cpu:2"))
    again = owner.load(spec_for("cpu:2"))
    other = owner.load(spec_for("cpu:2", path="/models/b.safetensors"))
    assert first is again and other is not first  # the pool's own cache answers the second load
    assert len(owner.pools) == 1 and len(owner.pools[0].handles) == 2


def test_layout_change_on_same_devices_restarts_the_pool(owner):
    owner.load(spec_for("cpu:2"))
    owner.load(spec_for("cpu:2", ring_degree=2))
    assert owner.pools[0].closed and not owner.pools[1].closed
    assert owner.pool_count == 1


def test_overlapping_gpus_close_the_older_pool_but_cpu_pools_coexist(owner):
    owner.load(spec_for("0,1"))
    owner.load(spec_for("1,2"))
    assert owner.pools[0].closed
    owner.load(spec_for("cpu:2"))
    owner.load(spec_for("cpu"))
    assert not owner.pools[2].closed and not owner.pools[3].closed
    assert owner.pool_count == 3


def test_unload_all_unloads_every_pool_and_counts_their_models(owner):
    owner.load(spec_for("cpu:2"))
    owner.load(spec_for("cpu:2", path="/models/b.safetensors"))
    owner.load(spec_for("cpu"))
    assert owner.unload_all() == 3 and [pool.unloads for pool in owner.pools] == [1, 1]
    assert owner.status()["pools"][0]["models"] == []


def test_every_load_asks_the_pool_for_the_specs_loras(owner):
    base = spec_for("cpu:2")
    with_lora = base.with_lora("/loras/x.safetensors", 0.5)
    handle = owner.load(with_lora)
    assert owner.load(base) is handle  # same weights: one model in the pool, whose LoRA list follows the spec
    assert owner.pools[0].lora_calls == [(handle, [["/loras/x.safetensors", 0.5]]), (handle, [])]
    served = owner.serving(base, patches="stock LoRA patch set")  # the stock nodes' weight patches
    assert owner.pools[0].lora_calls[-1] == (handle, [], "stock LoRA patch set")
    assert served.patches == "stock LoRA patch set"


def test_a_held_handle_serves_every_call_until_its_pool_is_closed_or_replaced(owner):
    """The SP MODEL holds its handle: calls ask the pool for nothing (no load, no file read); the handle's pool
    reloads the model itself after an unload or a restart (test_pool_lifecycle). A closed pool loads it again."""
    spec = spec_for("cpu:2")
    handle = owner.serving(spec)
    for patches in (None, "patch set", None):
        assert owner.serving(spec, handle, patches) is handle and handle.patches == patches
    assert owner.pools[0].loads == 1
    owner.load(spec_for("cpu:2", ring_degree=2))  # another layout on the same devices replaces the pool
    again = owner.serving(spec, handle)
    assert again is not handle and again.pool is owner.pools[2] and owner.pools[0].closed
    owner.shutdown()
    assert owner.serving(spec, again).pool is owner.pools[3]


def test_call_goes_through_the_handle_and_step_events_carry_the_devices(owner):
    x = torch.ones(1, 4, 8, 8)
    assert torch.equal(owner.serving(spec_for("cpu:2"))(x, torch.ones(1), y=3), x * 2)
    pool = owner.pools[0]
    assert pool.handles[("/models/a.safetensors", "default")].calls == [(x.shape, {"y": 3})]
    pool.emit({"event": "call", "seconds": 0.5, "layout": "u2", "speedup": 1.7})
    step = [data for event, data in owner.events if event == "ulysses_sp.step"][-1]
    assert step == {"devices": ["cpu", "cpu"], "event": "call", "seconds": 0.5, "layout": "u2", "speedup": 1.7}


def test_status_is_json_and_shows_what_the_pools_report(owner):
    owner.load(spec_for("cpu:2"))
    status = json.loads(json.dumps(owner.status()))
    pool = status["pools"][0]
    assert pool["devices"] == ["cpu", "cpu"] and pool["layout"] == "u2" and pool["backend"] == "gloo"
    assert pool["state"] == "idle" and pool["last_step"] is None
    assert pool["models"] == [{"path": "/models/a.safetensors", "dtype": "default", "options": {}, "loras": []}]
    assert [rank["rank"] for rank in pool["pool"]["ranks"]] == [0, 1]
    assert any(event == "ulysses_sp.status" for event, _ in owner.events)


def test_pool_events_are_forwarded_with_their_devices(owner):
    owner.load(spec_for("cpu:2"))
    owner.events.clear()
    owner.pools[0].emit({"event": "worker_died", "rank": 1})
    assert owner.events[0] == ("ulysses_sp.pool", {"devices": ["cpu", "cpu"], "event": "worker_died", "rank": 1})
    assert owner.events[1][0] == "ulysses_sp.status"  # the panel redraws after a fault
    owner.pools[0].emit({"event": "state", "state": "busy", "activity": "sampling"})
    assert owner.events[-1] == ("ulysses_sp.state", {"devices": ["cpu", "cpu"], "state": "sampling"})


def test_broken_listener_never_breaks_a_call(owner):
    owner.add_listener(lambda event, data: 1 / 0)
    owner.serving(spec_for("cpu:2"))(torch.ones(1, 1), torch.ones(1))


def test_shutdown_closes_every_pool(owner):
    owner.load(spec_for("cpu:2"))
    owner.load(spec_for("0"))
    assert owner.shutdown() == 2
    assert all(pool.closed for pool in owner.pools) and owner.status()["pools"] == []
