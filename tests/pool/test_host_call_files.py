"""A denoising call reads nothing from disk on the host: no path resolution, stat, header read, detection or file
open, through the model handle and through the pool owner as the SP MODEL calls it (nodes/pool_owner.py, no
ComfyUI). Detection runs once per load on the host; the load request carries it to the workers and their LoRAs."""
import builtins
import io
import os

import pytest
import safetensors
import torch

from comfy_support import import_node_module
from sp_runtime.checkpoints import header as header_module
from sp_runtime.config import SPConfig
from sp_lab.tiny_models.quant_files import write_quantized

pytest_plugins = ["family_pools"]
pool_owner = import_node_module("pool_owner")
model_spec = import_node_module("model_spec")
CALLS = 20


@pytest.fixture(scope="session")
def mixed_file(tmp_path_factory):
    """A tiny Qwen-Image in ComfyUI's mixed precision: detecting it reads its `.comfy_quant` entries from the file."""
    folder = tmp_path_factory.mktemp("host_call")
    path = str(folder / "qwen_image_mixed.safetensors")
    write_quantized("qwen_image", path, str(folder / "reference.safetensors"), "comfy_quant")
    return path


@pytest.fixture
def owner(family_pool):
    """A pool owner whose pool for one CPU device is the shared degree-1 pool (closed by its fixture)."""
    return pool_owner.PoolOwner(lambda config: family_pool)


class DiskReads:
    """Counts, in this process, what touches the checkpoint's folder and every header read, detection and
    safetensors open."""

    def __init__(self, monkeypatch, folder: str):
        self.seen: list[str] = []
        self.folder = folder
        for module, name in ((builtins, "open"), (io, "open"), (os, "open"), (os, "stat"), (os, "lstat")):
            monkeypatch.setattr(module, name, self._watch_path(f"{module.__name__}.{name}", getattr(module, name)))
        for module, name in ((header_module, "read_header"), (safetensors, "safe_open")):
            monkeypatch.setattr(module, name, self._watch(f"{module.__name__}.{name}", getattr(module, name)))
        import sp_runtime.detection as detection
        monkeypatch.setattr(detection, "detect", self._watch("detect", detection.detect))

    def _watch_path(self, what, original):
        def watched(path, *args, **kwargs):
            if isinstance(path, (str, os.PathLike)) and os.fspath(path).startswith(self.folder):
                self.seen.append(f"{what}({path})")
            return original(path, *args, **kwargs)
        return watched

    def _watch(self, what, original):
        def watched(*args, **kwargs):
            self.seen.append(what)
            return original(*args, **kwargs)
        return watched


def qwen_call():
    return torch.randn(1, 16, 1, 6, 4), torch.tensor([0.5]), torch.randn(1, 5, 32)


@pytest.mark.parametrize("family_pool", [1], indirect=True)
def test_calls_through_the_handle_and_the_pool_owner_read_no_file(owner, mixed_file, monkeypatch):
    spec = model_spec.ModelSpec.create(SPConfig(devices=["cpu"]), mixed_file)
    handle = owner.serving(spec)  # the first call loads: the header is read and detected once, here
    x, timestep, context = qwen_call()
    expected = handle(x, timestep, context=context)
    reads = DiskReads(monkeypatch, os.path.dirname(mixed_file))
    for _ in range(CALLS):
        assert torch.equal(handle(x, timestep, context=context), expected)
    held = handle
    for _ in range(CALLS):  # as nodes/proxy.SPDiffusionModel calls: the handle it holds, through the owner
        held = owner.serving(spec, held)
        assert torch.equal(held(x, timestep, context=context), expected)
    assert held is handle and reads.seen == []


def test_the_load_request_carries_the_detection_so_workers_and_loras_detect_nothing(mixed_file, monkeypatch):
    """The host detects once; a worker loading the request and a LoRA reading its base weights use its detection."""
    from sp_runtime.contract import LoadRequest
    from sp_runtime.lora.apply import lora_state
    from sp_runtime.pool import pool as pool_module
    from sp_runtime.pool.loading import load_worker_model
    request = pool_module._load_request(mixed_file, "default", {})
    assert request.detection.family == "qwen_image" and request.detection.quant.startswith("comfy_quant")
    sent = LoadRequest.from_message(request.to_message())  # JSON over the pipe: the detection arrives whole
    assert sent.detection == request.detection
    import sp_runtime.detection as detection
    monkeypatch.setattr(detection, "detect", lambda *args, **kwargs: pytest.fail("detected again"))
    worker = load_worker_model(sent, "cpu", None, None)
    assert worker.info.quant == request.detection.quant
    base = lora_state(worker, sent.header, torch.device("cpu"), sent.detection).base
    assert base.prefix == request.detection.prefix


@pytest.mark.parametrize("family_pool", [1], indirect=True)
def test_steady_calls_add_no_segment_and_hand_out_the_output_in_place(family_pool, mixed_file):
    """Repeat calls of a real family reuse the pool's segments, and the result is the output segment itself (no copy
    on the host); a result still held when the next call comes keeps its values (that call writes elsewhere)."""
    handle = family_pool.load_model(mixed_file)
    x, timestep, context = qwen_call()
    expected = handle(x, timestep, context=context).clone()
    segments = family_pool.segment_names()
    for _ in range(3):
        out = handle(x, timestep, context=context)
        assert torch.equal(out, expected)
        assert out.untyped_storage().data_ptr() == family_pool._outputs.segment.base.data_ptr()
        del out
        assert family_pool.segment_names() == segments
    held = handle(x, timestep, context=context)
    other = handle(x + 1, timestep, context=context)
    assert torch.equal(held, expected) and not torch.equal(other, expected)
