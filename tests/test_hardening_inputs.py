"""Files and text from strangers fail fast and bounded, with an error naming the file / field / limit (issue 33):
device text, the internal families' metadata, safetensors byte ranges, kohya LoRA names, GGUF metadata, ComfyUI
quant metadata, and the errors that used to name nothing. Every crafted file is built here, small."""
import json
import struct
import time

import pytest
import torch
from safetensors.torch import save_file

from sp_runtime import devices
from sp_runtime.families.detect import INTERNAL_FAMILIES_ENV, detect
from sp_runtime.families.header import MAX_HEADER_BYTES, read_header
from sp_runtime.pool.pool import _load_request

FAST_S = 1.0  # what "fails fast" means here: the old code took seconds to hours on these inputs


def raw_safetensors(path, header: dict, data_bytes: int) -> str:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(data_bytes))
    return str(path)


def timed(function, *args):
    start = time.perf_counter()
    try:
        function(*args)
    except ValueError as error:
        return time.perf_counter() - start, str(error)
    raise AssertionError(f"{function.__name__}{args!r} did not raise")


# ---- 1. device text -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, words", [
    ("0-99999999", ["GPU index 99999999", "above 127"]),
    ("0-" + "9" * 900, ["above 127"]),
    ("5,0-127,0-127", ["more than once"]),
    (",".join(["cpu:64"] * 3), ["192 CPU workers", "limit of 64"]),
    ("0," * 600 + "1", ["characters", "limit of 1024"]),
])
def test_device_text_is_bounded(text, words):
    seconds, message = timed(devices.parse_devices, text, 128)
    assert seconds < FAST_S / 10, f"{seconds:.2f} s"
    for word in words:
        assert word in message


def test_every_gpu_index_torch_can_name_still_parses():
    assert devices.parse_devices("0-127", cuda_count=128)[-1] == "cuda:127"
    assert devices.parse_devices("cuda:007", cuda_count=8) == ["cuda:7"]


# ---- 2. the project's own families only on an opt-in ----------------------------------------------------------
@pytest.mark.parametrize("family", ["synthetic", "toy"])
def test_internal_family_named_by_a_file_is_refused(tmp_path, monkeypatch, family):
    path = str(tmp_path / "downloaded.safetensors")
    spec = {"family": "flux", "config": {"num_layers": 10 ** 6}, "seed": 0, "dtype": "float32"}
    save_file({}, path, metadata={"ulysses_sp.family": family, "ulysses_sp.config": json.dumps(spec)})
    monkeypatch.delenv(INTERNAL_FAMILIES_ENV, raising=False)
    with pytest.raises(ValueError, match=f"names the model family '{family}'.*test / benchmark") as error:
        _load_request(path, "default", {})
    assert path in str(error.value) and INTERNAL_FAMILIES_ENV in str(error.value)
    monkeypatch.setenv(INTERNAL_FAMILIES_ENV, "1")  # what tests/conftest.py and the benchmarks set
    assert detect(path).family == family


def test_metadata_cannot_opt_in(tmp_path, monkeypatch):
    path = str(tmp_path / "downloaded.safetensors")
    save_file({}, path, metadata={"ulysses_sp.family": "synthetic", INTERNAL_FAMILIES_ENV: "1",
                                  "ulysses_sp.config": "{}"})
    monkeypatch.delenv(INTERNAL_FAMILIES_ENV, raising=False)
    with pytest.raises(ValueError, match="test / benchmark"):
        detect(path)


# ---- 3. safetensors byte ranges -------------------------------------------------------------------------------
F32_4 = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
BAD_RANGES = {
    "shape larger than its bytes": ({"w": {**F32_4, "shape": [4096, 4096]}}, 16, ["'w'", "[4096, 4096]", "16 bytes"]),
    "shape smaller than its bytes": ({"w": {**F32_4, "shape": [2]}}, 16, ["'w'", "8 bytes"]),
    "dtype wider than its bytes": ({"w": {**F32_4, "dtype": "F64"}}, 16, ["'w'", "F64"]),
    "two tensors on one range": ({"a": F32_4, "b": F32_4}, 16, ["'a'", "'b'", "overlap"]),
    "ranges that cross": ({"a": F32_4, "b": {**F32_4, "data_offsets": [8, 24]}}, 24, ["'a'", "'b'", "overlap"]),
    "fp4 with half a byte": ({"w": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, 2, ["'w'", "1.5 bytes"]),
}


@pytest.mark.parametrize("case", sorted(BAD_RANGES))
def test_header_byte_ranges_are_exact(tmp_path, case):
    header, data_bytes, words = BAD_RANGES[case]
    path = raw_safetensors(tmp_path / "crafted.safetensors", header, data_bytes)
    with pytest.raises(ValueError) as error:
        _load_request(path, "default", {})  # the host, before any worker
    for word in [path, *words]:
        assert word in str(error.value)


def test_packed_and_empty_tensors_still_read(tmp_path):
    header = {"w": {"dtype": "F4", "shape": [4, 2], "data_offsets": [0, 4]}, "e": {**F32_4, "shape": [0, 2],
                                                                                  "data_offsets": [4, 4]},
              "b": {"dtype": "BF16", "shape": [3], "data_offsets": [4, 10]}}
    assert read_header(raw_safetensors(tmp_path / "ok.safetensors", header, 10)).tensors["w"] == ("F4", (4, 2))


def test_header_length_is_bounded(tmp_path):
    path = tmp_path / "huge_header.safetensors"
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", MAX_HEADER_BYTES + 1))
        handle.truncate(MAX_HEADER_BYTES + 64)  # sparse: no disk used
    seconds, message = timed(read_header, str(path))
    assert seconds < FAST_S and str(path) in message and f"limit of {MAX_HEADER_BYTES}" in message
