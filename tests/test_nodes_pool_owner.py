"""The pool owner (nodes/pool_owner.py): one pool per device set, reuse, layout changes, LoRA sync, events and
status; against a fake pool so it needs neither ComfyUI nor worker processes."""
import json

import pytest
import torch

from comfy_support import import_node_module
from sp_runtime.config import config_from_inputs

owner_module = import_node_module("pool_owner")


class FakeHandle:
    def __init__(self, pool, path, dtype, options):
        self.pool, self.path, self.dtype, self.options = pool, path, dtype, options
        self.closed = False
        self.calls = []

    def __call__(self, x, timestep, context=None, should_cancel=None, **extra):
        self.calls.append((x.shape, extra))
        return x * 2


class FakePool:
    def __init__(self, config, with_loras=True):
        self.config = config
        self.loaded, self.unloaded, self.lora_calls = [], [], []
        self.closed = False
        self.listeners = []
        if not with_loras:
            self.set_loras = None

    def load_model(self, path, dtype="default", progress=None, **options):
        if progress:
            progress(1.0, "loaded")
        handle = FakeHandle(self, path, dtype, options)
        self.loaded.append(handle)
        return handle

    def set_loras(self, handle, loras):
        self.lora_calls.append((handle, loras))

    def unload(self, handle):
        handle.closed = True
        self.unloaded.append(handle)

    def close(self):
        self.closed = True

    def status(self):
        return {"ranks": [{"rank": r, "device": d} for r, d in enumerate(self.config.devices)]}

    def add_listener(self, listener):
        self.listeners.append(listener)


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
    return owner_module.ModelSpec.create(config_from_inputs(text, cuda_count=cuda, **degrees), path)


def test_one_pool_per_device_set_reused_across_models_and_prompts(owner):
    first = owner.load(spec_for("cpu:2"))
    again = owner.load(spec_for("cpu:2"))
    other = owner.load(spec_for("cpu:2", path="/models/b.safetensors"))
    assert first is again and other is not first
    assert len(owner.pools) == 1 and len(owner.pools[0].loaded) == 2


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


def test_unloaded_model_reloads_on_next_use(owner):
    spec = spec_for("cpu:2")
    handle = owner.load(spec)
    assert owner.unload_all() == 1 and owner.pools[0].unloaded == [handle]
    assert owner.load(spec) is not handle
    assert len(owner.pools[0].loaded) == 2


def test_loras_are_synced_only_when_they_change(owner):
    base = spec_for("cpu:2")
    with_lora = base.with_lora("/loras/x.safetensors", 0.5)
    handle = owner.load(with_lora)
    owner.load(with_lora)
    assert owner.pools[0].lora_calls == [(handle, [["/loras/x.safetensors", 0.5]])]
    assert owner.load(base) is handle  # same weights, LoRA removed
    assert owner.pools[0].lora_calls[-1] == (handle, [])


def test_lora_without_pool_support_is_a_clear_error():
    created = owner_module.PoolOwner(lambda config: FakePool(config, with_loras=False))
    spec = spec_for("cpu:2").with_lora("/loras/x.safetensors", 1.0)
    with pytest.raises(RuntimeError, match="cannot apply LoRAs"):
        created.load(spec)


def test_call_records_steps_and_speedup_against_a_single_device_run(owner):
    x = torch.ones(1, 4, 8, 8)
    single = spec_for("cpu")
    split = spec_for("cpu:2")
    assert torch.equal(owner.call(split, x, torch.ones(1)), x * 2)
    steps = [data for event, data in owner.events if event == "ulysses_sp.step"]
    assert steps[-1]["layout"] == "u2" and steps[-1]["speedup"] is None  # nothing to compare with yet
    owner.call(single, x, torch.ones(1))
    owner.call(split, x, torch.ones(1))
    step = [data for event, data in owner.events if event == "ulysses_sp.step"][-1]
    assert step["speedup"] is not None and step["speedup"] > 0
    assert step["shape"] == [1, 4, 8, 8] and step["world_size"] == 2


def test_status_is_json_and_lists_pools_models_and_ranks(owner):
    owner.load(spec_for("cpu:2").with_lora("/loras/x.safetensors", 0.7))
    status = json.loads(json.dumps(owner.status()))
    pool = status["pools"][0]
    assert pool["devices"] == ["cpu", "cpu"] and pool["layout"] == "u2" and pool["backend"] == "gloo"
    assert pool["models"] == [{"path": "/models/a.safetensors", "dtype": "default", "options": {},
                               "loras": [["/loras/x.safetensors", 0.7]]}]
    assert [rank["rank"] for rank in pool["pool"]["ranks"]] == [0, 1]
    assert any(event == "ulysses_sp.status" for event, _ in owner.events)


def test_pool_events_are_forwarded_with_their_devices(owner):
    owner.load(spec_for("cpu:2"))
    owner.events.clear()
    owner.pools[0].listeners[0]({"event": "worker_died", "rank": 1})
    assert owner.events[0] == ("ulysses_sp.pool", {"devices": ["cpu", "cpu"], "event": "worker_died", "rank": 1})
    assert owner.events[1][0] == "ulysses_sp.status"  # the panel redraws after a fault


def test_broken_listener_never_breaks_a_call(owner):
    owner.add_listener(lambda event, data: 1 / 0)
    owner.call(spec_for("cpu:2"), torch.ones(1, 1), torch.ones(1))


def test_shutdown_closes_every_pool(owner):
    owner.load(spec_for("cpu:2"))
    owner.load(spec_for("0"))
    assert owner.shutdown() == 2
    assert all(pool.closed for pool in owner.pools) and owner.status()["pools"] == []
