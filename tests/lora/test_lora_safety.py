"""LoRAs that cannot hurt the workers: a LoRA applied all-or-nothing (a LoRA whose second adapter is malformed, or a
failure part-way through writing, leaves every weight exactly as it was), and factors kept unmerged on quantized
layers owned by the worker, not views of the LoRA file's memory map (rewriting the file in place must not SIGBUS)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from sp_runtime.config import SPConfig
from sp_runtime.contract import LoadRequest
from sp_runtime.pool.loading import load_worker_model
from sp_runtime.lora import apply as apply_module
from sp_runtime.lora.apply import lora_state
from sp_runtime.pool import WorkerPool
from sp_lab.tiny_models import write_tiny_checkpoint
from sp_lab.tiny_models.quant_files import write_quantized

H = 96  # the tiny Qwen-Image's width


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A tiny Qwen-Image loaded in this process (world 1) with its LoRA state, and a good two-adapter LoRA."""
    folder = tmp_path_factory.mktemp("lora_safety")
    path = write_tiny_checkpoint("qwen_image", str(folder / "base.safetensors"), seed=2)
    request = LoadRequest(path, "fp32")
    model = load_worker_model(request, torch.device("cpu"), None, lambda *_: None)
    g = torch.Generator().manual_seed(3)
    good = str(folder / "good.safetensors")
    save_file({f"transformer_blocks.{b}.attn.to_q.lora_{p}.weight": torch.randn(*shape, generator=g)
               for b in (0, 1) for p, shape in (("A", (4, H)), ("B", (H, 4)))}, good)
    return model, lora_state(model, path, torch.device("cpu")), good, folder


def weights(model) -> dict:
    return {name: value.detach().clone() for name, value in model.model.state_dict().items()}


def assert_same(before: dict, model) -> None:
    after = model.model.state_dict()
    changed = [name for name, value in before.items() if not torch.equal(value, after[name])]
    assert not changed, f"weights changed by a failed LoRA: {changed}"


def test_a_three_d_up_tensor_in_the_second_adapter_changes_nothing(qwen):
    model, state, good, folder = qwen
    state.set([[good, 0.5]])
    before = weights(model)
    bad = str(folder / "bad_second.safetensors")
    g = torch.Generator().manual_seed(4)
    save_file({"transformer_blocks.0.attn.to_k.lora_A.weight": torch.randn(4, H, generator=g),
               "transformer_blocks.0.attn.to_k.lora_B.weight": torch.randn(H, 4, generator=g),
               "transformer_blocks.1.attn.to_k.lora_A.weight": torch.randn(4, H, generator=g),
               "transformer_blocks.1.attn.to_k.lora_B.weight": torch.randn(H, 4, 2, generator=g)}, bad)
    with pytest.raises(ValueError, match=r"transformer_blocks\.1\.attn\.to_k\.lora_B\.weight.*\[96, 4, 2\]"):
        state.set([[good, 0.5], [bad, 1.0]])
    assert_same(before, model)
    state.set([])  # still usable: the base comes back


def test_a_failure_part_way_through_writing_restores_what_was_written(qwen, monkeypatch):
    model, state, good, folder = qwen
    state.set([[good, 0.5]])
    before = weights(model)
    writes, real_store = [], apply_module._Store.__call__

    def failing_store(self, name, value):
        writes.append(name)
        if len(writes) == 2:
            raise RuntimeError("disk error while writing the second weight")
        real_store(self, name, value)
    monkeypatch.setattr(apply_module._Store, "__call__", failing_store)
    with pytest.raises(RuntimeError, match="second weight"):
        state.set([[good, 1.5]])
    monkeypatch.undo()
    assert len(writes) >= 2
    assert_same(before, model)
    state.set([[good, 1.5]])  # the same request works once the fault is gone
    state.set([])


def test_unmerged_factors_survive_the_lora_file_rewritten_in_place(tmp_path):
    path, reference = str(tmp_path / "flux_q.safetensors"), str(tmp_path / "flux_ref.safetensors")
    write_quantized("flux", path, reference, "comfy_quant", only="float8_e4m3fn")
    base = load_file(reference)
    g = torch.Generator().manual_seed(5)
    lora = str(tmp_path / "lora.safetensors")
    module = "double_blocks.0.img_attn.qkv"  # quantized: its LoRA stays unmerged
    rows, cols = base[f"{module}.weight"].shape
    save_file({f"diffusion_model.{module}.lora_B.weight": torch.randn(rows, 4, generator=g),
               f"diffusion_model.{module}.lora_A.weight": torch.randn(4, cols, generator=g)}, lora)
    x = torch.randn(1, 16, 9, 7, generator=g)
    kwargs = {"context": torch.randn(1, 5, 32, generator=g), "y": torch.randn(1, 24, generator=g),
              "guidance": torch.tensor([3.5])}
    with WorkerPool(SPConfig(["cpu"])) as pool:
        handle = pool.load_model(path)
        handle.set_loras([[lora, 0.8]])
        first = handle(x, torch.tensor([0.5]), **kwargs)
        with open(lora, "r+b") as file:  # rewritten in place: the old mapping's pages go away
            file.truncate(0)
            file.write(b"\0" * 64)
        again = handle(x, torch.tensor([0.5]), **kwargs)
        assert pool.restarts == 0 and torch.equal(first, again)
