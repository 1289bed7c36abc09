"""Bad checkpoint files give an error naming the file and what is wrong (sp_runtime/checkpoints/header.py), on the host,
before any worker reads them: never a bare KeyError / TypeError / JSON error, nor "does not exist" for a file that
exists but is not a regular one."""
import json
import os
import struct

import pytest
import torch
from safetensors.torch import save_file

from sp_runtime.detection import detect
from sp_runtime.checkpoints.header import read_checkpoint_header
from sp_runtime.pool.pool import _load_request


def raw_safetensors(path, header) -> str:
    """A file with the given header object (any JSON) and 16 data bytes."""
    text = json.dumps(header).encode()
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(text)) + text + bytes(16))
    return str(path)


GOOD_ENTRY = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
BAD_HEADERS = {
    "header is a list": ([GOOD_ENTRY], ["header is a JSON list"]),
    "unknown dtype": ({"w": {**GOOD_ENTRY, "dtype": "bogus"}}, ["'w'", "unknown dtype 'bogus'"]),
    "no data_offsets": ({"w": {"dtype": "F32", "shape": [2, 2]}}, ["'w'", "data_offsets"]),
    "entry not an object": ({"w": 3}, ["'w'", "data_offsets"]),
    "bad shape": ({"w": {**GOOD_ENTRY, "shape": "2x2"}}, ["'w'", "invalid shape"]),
    "bad offsets": ({"w": {**GOOD_ENTRY, "data_offsets": [16, 0]}}, ["'w'", "invalid data_offsets"]),
    "metadata not strings": ({"__metadata__": {"a": 1}, "w": GOOD_ENTRY}, ["__metadata__"]),
    "truncated": ({"w": {**GOOD_ENTRY, "data_offsets": [0, 64]}}, ["truncated", "'w'"]),
}


@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
def test_damaged_header_is_named(tmp_path, case):
    header, words = BAD_HEADERS[case]
    path = raw_safetensors(tmp_path / "bad.safetensors", header)
    with pytest.raises(ValueError) as error:
        detect(path)
    for word in [path, *words]:
        assert word in str(error.value)


def test_unknown_family_in_metadata_is_named(tmp_path):
    path = str(tmp_path / "bogus.safetensors")
    save_file({"w": torch.zeros(2)}, path, metadata={"ulysses_sp.family": "bogus"})
    with pytest.raises(ValueError, match="names the model family 'bogus'.*does not know") as error:
        _load_request(path, "default", {})
    assert path in str(error.value)


def test_header_that_is_not_json_names_the_file(tmp_path):
    path = tmp_path / "notjson.safetensors"
    path.write_bytes(struct.pack("<Q", 4) + b"{no}" + bytes(8))
    with pytest.raises(ValueError, match="header is not JSON") as error:
        detect(str(path))
    assert str(path) in str(error.value)


@pytest.mark.parametrize("name, what", [("config.json", "config.json"),
                                        ("model.safetensors.index.json", "shard index")])
def test_bad_json_in_a_model_folder_names_that_file(tmp_path, name, what):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
    (folder / name).write_text("{broken")
    with pytest.raises(ValueError, match="is not valid JSON") as error:
        read_checkpoint_header(str(folder))
    assert str(folder / name) in str(error.value) and what in str(error.value)


def test_fifo_is_not_reported_missing_and_never_opened(tmp_path):
    path = tmp_path / "pipe.safetensors"
    os.mkfifo(path)  # opening it for reading would block
    with pytest.raises(ValueError, match="FIFO") as error:
        detect(str(path))
    assert str(path) in str(error.value) and "does not exist" not in str(error.value)


def test_symlink_loop_is_not_reported_missing(tmp_path):
    path = tmp_path / "loop.safetensors"
    os.symlink(path, path)
    with pytest.raises(ValueError, match="cannot be opened.*symbolic links") as error:
        _load_request(str(path), "default", {})
    assert str(path) in str(error.value) and "does not exist" not in str(error.value)


def test_broken_symlink_says_so(tmp_path):
    path = tmp_path / "broken.safetensors"
    os.symlink(tmp_path / "gone.safetensors", path)
    with pytest.raises(ValueError, match="broken symbolic link"):
        detect(str(path))


def test_missing_file_still_says_it_does_not_exist(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        detect(str(tmp_path / "absent.safetensors"))


def test_header_is_read_once_per_load_and_travels_to_the_workers(tmp_path, monkeypatch):
    from sp_runtime.checkpoints import header as header_module
    from sp_lab.families import toy
    from sp_runtime.contract import LoadRequest
    from sp_runtime.pool.loading import load_worker_model

    path = str(tmp_path / "toy.safetensors")
    toy.save_toy_checkpoint(path, hidden=24, heads=3)
    reads, real = [], header_module.read_header
    monkeypatch.setattr(header_module, "read_header", lambda file: reads.append(file) or real(file))
    request = _load_request(path, "default", {})
    assert reads == [path]  # the host: once, for detection and for the workers

    def no_read(file):
        raise AssertionError(f"a worker read the header of {file} again")
    monkeypatch.setattr(header_module, "read_header", no_read)
    monkeypatch.setattr(toy, "read_header", no_read)
    received = LoadRequest.from_message(json.loads(json.dumps(request.to_message())))
    assert received == request and received.header == request.header
    worker = load_worker_model(received, torch.device("cpu"), None, lambda *_: None)
    assert worker.info.family == "toy"


def test_lora_fifo_is_not_reported_missing(tmp_path):
    from sp_runtime.lora.files import read_lora_file
    path = tmp_path / "lora.safetensors"
    os.mkfifo(path)
    with pytest.raises(ValueError, match="FIFO") as error:
        read_lora_file(str(path))
    assert str(path) in str(error.value) and "does not exist" not in str(error.value)


def test_read_file_tensor_finds_a_tensor_by_its_name_under_any_prefix(tmp_path):
    import torch
    from safetensors.torch import save_file
    from sp_runtime.checkpoints.header import read_file_tensor
    stored = torch.arange(6.0).reshape(2, 3)
    path = str(tmp_path / "model.safetensors")
    save_file({"model.diffusion_model.positive_conditioning": stored, "model.diffusion_model.x.weight": stored * 2,
               "other_conditioning": stored * 3}, path)
    assert torch.equal(read_file_tensor(path, "positive_conditioning"), stored)
    assert torch.equal(read_file_tensor(path, "other_conditioning"), stored * 3)
    with pytest.raises(KeyError, match="negative_conditioning"):
        read_file_tensor(path, "negative_conditioning")
    with pytest.raises(KeyError):
        read_file_tensor(path, "conditioning")  # a suffix only after a dot: not "positive_conditioning"
