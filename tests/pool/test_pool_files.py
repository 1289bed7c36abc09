"""Checkpoints that change on disk: a replaced file is loaded again (never the old weights), the same file through a
symlink or under "default" vs its own dtype is one model, and a loaded CPU model owns its weights (rewriting or
truncating the file changes nothing and kills no worker)."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from family_support import at_worlds
from sp_runtime.checkpoints.header import check_unchanged, checkpoint_stamp
from pool_kit import assert_matches, reference, toy_checkpoint, toy_inputs


pytest_plugins = ["family_pools"]  # the shared plain pools (degree 2 here)


def call(model, seed=0):
    inputs = toy_inputs(seed=seed)
    return model(inputs["x"], inputs["timestep"], context=inputs["context"], y=inputs["y"]), inputs


def other_weights(folder, like: str, seed: int) -> bytes:
    """The bytes of a checkpoint like `like` (same size) with other weights."""
    path = toy_checkpoint(folder, "other.safetensors", seed=seed)
    with open(path, "rb") as handle:
        data = handle.read()
    assert len(data) == os.path.getsize(like)
    return data


@at_worlds(2)
def test_a_symlink_and_the_default_dtype_are_one_model(plain_pool, tmp_path):
    path = toy_checkpoint(tmp_path)
    link = tmp_path / "link.safetensors"
    link.symlink_to(path)
    plain_pool.unload_all()
    handles = [plain_pool.load_model(path), plain_pool.load_model(link),
               plain_pool.load_model(path, dtype="float32"), plain_pool.load_model(link, dtype=torch.float32)]
    assert len({handle.key for handle in handles}) == 1 and handles[0].path == os.path.realpath(path)
    assert len(plain_pool.status()["models"]) == 1
    assert plain_pool.load_model(path, dtype="bfloat16").key != handles[0].key  # another dtype is another model


@at_worlds(2)
def test_a_replaced_file_is_loaded_again(plain_pool, tmp_path):
    path = toy_checkpoint(tmp_path, seed=1)
    old = plain_pool.load_model(path)
    before, inputs = call(old)
    shutil.move(toy_checkpoint(tmp_path, "new.safetensors", seed=2), path)
    new = plain_pool.load_model(path)
    assert new.key != old.key
    out, _ = call(new)
    assert_matches(out, reference(path)(**inputs))
    assert not torch.allclose(out, before)
    kept = [model["key"] for model in plain_pool.status()["models"] if model["path"] == new.path]
    assert kept == [new.key]  # the old copy was unloaded
    out_old_handle, _ = call(old)  # an older handle follows the file too
    assert_matches(out_old_handle, reference(path)(**inputs))


@at_worlds(2)
def test_rewriting_or_truncating_a_loaded_file_changes_nothing(plain_pool, tmp_path):
    path = toy_checkpoint(tmp_path, seed=3)
    model = plain_pool.load_model(path)
    before, inputs = call(model, seed=5)
    before = before.clone()  # kept across later calls: a private copy
    assert_matches(before, reference(path)(**inputs))
    pids, restarts = plain_pool.worker_pids, plain_pool.restarts
    with open(path, "r+b") as handle:  # in place: the same inode, other weights
        handle.write(other_weights(tmp_path, path, seed=4))
    assert torch.equal(call(model, seed=5)[0], before)
    os.truncate(path, 0)
    assert torch.equal(call(model, seed=5)[0], before)
    assert plain_pool.worker_pids == pids and plain_pool.restarts == restarts


def test_a_load_refuses_a_file_changed_after_it_was_chosen(tmp_path):
    path = toy_checkpoint(tmp_path, seed=7)
    stamp = checkpoint_stamp(path)
    check_unchanged(path, stamp)
    shutil.move(toy_checkpoint(tmp_path, "new.safetensors", seed=8), path)
    with pytest.raises(ValueError, match="changed on disk .*load it again"):
        check_unchanged(path, stamp)


def test_family_loads_copy_cpu_weights_out_of_the_file(tmp_path):
    from safetensors.torch import save_file

    from sp_runtime.checkpoints.loading import CheckpointSource, WeightDtypes, load_weights
    path = str(tmp_path / "linear.safetensors")
    weights = {"weight": torch.randn(4, 3), "bias": torch.randn(4)}
    save_file(weights, path)
    model = load_weights(torch.nn.Linear(3, 4), CheckpointSource(path, (path,)), device="cpu",
                         dtypes=WeightDtypes(torch.float32, torch.float32))
    save_file({name: torch.zeros_like(tensor) for name, tensor in weights.items()}, path + ".new")
    with open(path, "r+b") as handle, open(path + ".new", "rb") as new:
        handle.write(new.read())  # in place: a mapping of the file would now read zeros
    assert torch.equal(model.weight, weights["weight"]) and torch.equal(model.bias, weights["bias"])
