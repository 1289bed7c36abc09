"""A worker freezes its long-lived objects (gc.freeze) only while it holds no model, so an unload's gc.collect()
is cheap yet still frees a model's reference cycles."""
import gc
import types
import weakref

import torch

from sp_runtime.pool import worker as worker_module
from sp_runtime.pool.context import DeviceCache


def _worker():
    worker = object.__new__(worker_module.Worker)
    worker.models, worker.requests, worker.lora_states, worker.patch_sets = {}, {}, {}, {}
    worker.cache, worker.device, worker.groups, worker.rank = DeviceCache(), torch.device("cpu"), None, 0
    worker.control = types.SimpleNamespace(cancel_requested=lambda: False)
    return worker


def _load(worker, path):
    request = {"path": path, "dtype": "float32", "options": {}, "stamp": []}
    return worker.op_load({"id": 1, "request": request})


def test_freeze_comes_before_a_load_and_only_with_no_model_loaded(monkeypatch):
    events, loaded = [], {}

    class CyclicModel(torch.nn.Module):  # a model whose modules refer back to it, as hooks do
        def __init__(self, path):
            super().__init__()
            self.info = types.SimpleNamespace(to_dict=lambda: {"path": path})
            self.__dict__["back"] = self

    def load(request, *args):
        events.append(("load", request.path))
        model = loaded[request.path] = CyclicModel(request.path)
        return model

    monkeypatch.setattr(gc, "freeze", lambda: events.append(("freeze", None)))
    monkeypatch.setattr(worker_module, "load_worker_model", load)
    monkeypatch.setattr(worker_module, "check_unchanged", lambda *args: None)
    worker = _worker()
    _load(worker, "a")
    _load(worker, "b")  # "a" is loaded: freezing now would make it uncollectable
    assert events == [("freeze", None), ("load", "a"), ("load", "b")]
    first = weakref.ref(loaded.pop("a"))
    worker.op_unload({"key": next(iter(worker.models))})
    assert first() is None, "an unloaded model's reference cycle was not collected"
    worker.op_unload({"all": True})
    _load(worker, "c")
    assert events[-2:] == [("freeze", None), ("load", "c")]
