"""The worker side of a load (pool/loading.py): a family that declares its Loading as data loads through the one
generic path, the same model and ModelInfo as its own load()."""
import torch

from sp_runtime.contract import Loading
from sp_runtime.families import qwen_image
from sp_runtime.pool import pool as pool_module
from sp_runtime.pool.loading import load_declared, load_worker_model
from sp_lab.tiny_models import write_tiny_checkpoint

QWEN_IMAGE = Loading("QwenImageTransformer2DModel", qwen_image.weight_plan, qwen_image.model_info, qwen_image.PLAN,
                     ignore=(qwen_image.EDIT_2511_MARKER,))


def test_a_declared_loading_builds_what_the_familys_load_builds(tmp_path, monkeypatch):
    path = str(tmp_path / "qwen_image.safetensors")
    write_tiny_checkpoint("qwen_image", path, dtype="bfloat16")
    request = pool_module._load_request(path, "default", {})
    own = qwen_image.load(request, request.detection, "cpu", None, None)
    declared = load_declared(QWEN_IMAGE, request, request.header, request.detection, "cpu", None)
    assert declared.info == own.info and declared.plan is own.plan and declared.dtypes == own.dtypes
    own_state, declared_state = own.model.state_dict(), declared.model.state_dict()
    assert own_state.keys() == declared_state.keys()
    assert all(torch.equal(own_state[key], declared_state[key]) for key in own_state)
    monkeypatch.setattr(qwen_image, "LOADING", QWEN_IMAGE, raising=False)  # the pool's worker takes the declaration
    monkeypatch.setattr(qwen_image, "load", lambda *args: None)
    assert load_worker_model(request, "cpu", None, None).info.family == "qwen_image"
