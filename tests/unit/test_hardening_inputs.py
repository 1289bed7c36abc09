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
from sp_runtime.detection import INTERNAL_FAMILIES_ENV, detect
from sp_runtime.checkpoints.header import MAX_HEADER_BYTES, read_header
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


def test_one_device_entry_is_bounded_too():
    with pytest.raises(ValueError, match="above 127"):
        devices.parse_device("cuda:" + "9" * 5000)  # int() of it would raise Python's own digit-limit error


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


# ---- 4. kohya LoRA names: table lookup, a bounded search per name pattern ---------------------------------------
@pytest.fixture(scope="module")
def flux_diffusers(tmp_path_factory):
    """A tiny Flux loaded from a diffusers-layout file: original kohya names are in no table of the model's."""
    from sp_runtime.families import flux
    from sp_lab.tiny_models import write_tiny_checkpoint
    path = write_tiny_checkpoint("flux", str(tmp_path_factory.mktemp("flux") / "flux.safetensors"), "diffusers")
    return path, flux.load_model(path)[0]


def write_kohya(path, names, rank=1) -> str:
    tensors = {}
    for name in names:
        tensors[f"{name}.lora_up.weight"] = torch.zeros(8, rank)
        tensors[f"{name}.lora_down.weight"] = torch.zeros(rank, 8)
    save_file(tensors, str(path))
    return str(path)


def test_original_kohya_names_resolve_on_a_diffusers_model(flux_diffusers, tmp_path):
    from sp_runtime.lora.apply import LoraState
    path, model = flux_diffusers
    state = LoraState(model, "flux", path, torch.device("cpu"))
    targets = state.resolver.resolve("lora_unet_double_blocks_1_img_attn_qkv", "weight")
    assert [t.parameter for t in targets] == [f"transformer_blocks.1.attn.to_{p}.weight" for p in "qkv"]
    assert state.resolver.resolve("lora_unet_final_layer_adaLN_modulation_1", "weight")[0].parameter == \
        "norm_out.linear.weight"


@pytest.mark.parametrize("words, names", [(15, 40), (12, 40)])
def test_crafted_kohya_names_fail_fast(flux_diffusers, tmp_path, words, names):
    """15 words: 2^14 spellings per name (the old decoder tried them all, name after name); 12 words: 2^11 each, the
    second name passes the file's budget."""
    from sp_runtime.lora.apply import LoraState
    from sp_runtime.lora.keys import MAX_DECODE_LOOKUPS
    path, model = flux_diffusers
    lora = write_kohya(tmp_path / "crafted.safetensors",
                       ["lora_unet_" + "_".join(f"w{index}x{word}" for word in range(words)) for index in range(names)])
    seconds, message = timed(LoraState(model, "flux", path, torch.device("cpu")).set, [[lora, 1.0]])
    assert seconds < FAST_S, f"{seconds:.1f} s"
    assert lora in message and f"limit of {MAX_DECODE_LOOKUPS}" in message and "spellings" in message


# ---- 6. GGUF metadata and ComfyUI quant entries, capped before parsing -----------------------------------------
def gguf_string(text: str) -> bytes:
    return struct.pack("<Q", len(text)) + text.encode()


def gguf_file(path, entries: bytes, entry_count: int, tensors: bytes = b"", tensor_count: int = 0,
              data: bytes = b"") -> str:
    """A GGUF v3 file from raw metadata / tensor-table bytes (what a crafted file states, however wrong)."""
    head = b"GGUF" + struct.pack("<IQQ", 3, tensor_count, entry_count) + entries + tensors
    path.write_bytes(head + bytes(-len(head) % 32) + data)
    return str(path)


def string_array(key: str, count: int) -> bytes:
    return gguf_string(key) + struct.pack("<IIQ", 9, 8, count) + gguf_string("") * count


def nested_arrays(key: str, depth: int) -> bytes:
    return gguf_string(key) + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * (depth - 1) + struct.pack("<IQ", 4, 0)


def f32_tensor(name: str, shape, offset: int = 0) -> bytes:
    return gguf_string(name) + struct.pack("<I", len(shape)) + struct.pack(f"<{len(shape)}Q", *shape) + \
        struct.pack("<IQ", 0, offset)


BAD_GGUF = {  # case -> (gguf_file arguments, words of the error)
    "huge string array": ((string_array("tokenizer.tokens", 300_000), 1), ["'tokenizer.tokens'", "65536 values"]),
    "metadata over 1 MiB": (((gguf_string("k") + struct.pack("<I", 8) + gguf_string("x" * 60_000)) * 20, 20),
                            ["metadata is larger than the limit of 1048576 bytes"]),
    "metadata count past the end": ((gguf_string("general.architecture") + struct.pack("<I", 8) + gguf_string("flux"),
                                     2 ** 40), ["ends inside metadata entry #"]),
    "deep nesting": ((nested_arrays("deep", 5000), 1), ["'deep'", "nests arrays deeper than the limit of 2"]),
    "tensor count": ((b"", 0, b"", 2 ** 40), ["tensor count 1099511627776", "limit of 65536"]),
    "tensor past the data": ((b"", 0, f32_tensor("w", (4, 4)), 1, bytes(32)), ["'w'", "ends at byte 64"]),
    "tensors overlap": ((b"", 0, f32_tensor("a", (4,)) + f32_tensor("b", (4,), 0), 2, bytes(32)),
                        ["'a'", "'b'", "overlap"]),
}


@pytest.mark.parametrize("case", sorted(BAD_GGUF))
def test_gguf_header_is_bounded(tmp_path, case):
    arguments, words = BAD_GGUF[case]
    path = gguf_file(tmp_path / "crafted.gguf", *arguments)
    seconds, message = timed(read_header, path)
    assert seconds < FAST_S, f"{seconds:.1f} s"
    for word in [path, *words]:
        assert word in message


def test_gguf_original_shape_must_hold_the_tensor(tmp_path):
    shape = gguf_string("comfy.gguf.orig_shape.w") + struct.pack("<IIQ", 9, 5, 2) + struct.pack("<ii", 4096, 4096)
    path = gguf_file(tmp_path / "crafted.gguf", shape, 1, f32_tensor("w", (4, 4)), 1, bytes(64))
    with pytest.raises(ValueError, match="comfy.gguf.orig_shape.w.*16 elements") as error:
        read_header(path)
    assert path in str(error.value)


def test_comfy_quant_entry_size_is_capped(tmp_path):
    from sp_runtime.formats import quantization
    from sp_runtime.formats.comfy_quant import MAX_LAYER_JSON_BYTES
    path = str(tmp_path / "crafted.safetensors")
    save_file({"blocks.0.w.weight": torch.zeros(4, 4, dtype=torch.int8),
               "blocks.0.w.comfy_quant": torch.full((8 * 1024 * 1024,), ord("["), dtype=torch.uint8)}, path)
    seconds, message = timed(quantization, read_header(path))
    assert seconds < FAST_S / 4 and path in message and "'blocks.0.w.comfy_quant'" in message
    assert f"at most {MAX_LAYER_JSON_BYTES} bytes" in message


# ---- 9. errors that used to name nothing ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quant_metadata_file(tmp_path_factory):
    """A tiny Flux in ComfyUI's int8 convrot layout, its layers listed in `_quantization_metadata`."""
    from sp_lab.tiny_models.quant_files import write_quantized
    folder = tmp_path_factory.mktemp("quant")
    path = str(folder / "int8.safetensors")
    write_quantized("flux", path, str(folder / "reference.safetensors"), "quant_metadata")
    return path


def with_metadata(source: str, path, change) -> str:
    from safetensors import safe_open
    from safetensors.torch import load_file
    with safe_open(source, "pt") as handle:
        metadata = handle.metadata()
    save_file(load_file(source), str(path), metadata={**metadata, "_quantization_metadata": change(
        metadata["_quantization_metadata"])})
    return str(path)


def set_group(size):
    def change(text):
        layers = json.loads(text)
        for entry in layers["layers"].values():
            if entry.get("convrot"):
                entry["convrot_groupsize"] = size
        return json.dumps(layers)
    return change


@pytest.mark.parametrize("change, words", [
    (lambda text: "{not json", ["'_quantization_metadata' is not valid JSON"]),
    (lambda text: "[1, 2]", ["no 'layers' object"]),
    (lambda text: json.dumps({"layers": {"double_blocks.0.img_mlp.0": "int8"}}),
     ["'double_blocks.0.img_mlp.0'", "not an object with a 'format'"]),
    (lambda text: json.dumps({"layers": {"double_blocks.0.img_mlp.0": {"scale": 1}}}), ["not an object with a"]),
    (set_group(0), ["convrot_groupsize 0", "power of 4"]),
    (set_group(32), ["convrot_groupsize 32", "power of 4"]),
])
def test_malformed_quant_metadata_names_file_and_layer(quant_metadata_file, tmp_path, change, words):
    path = with_metadata(quant_metadata_file, tmp_path / "bad.safetensors", change)
    with pytest.raises(ValueError) as error:
        _load_request(path, "default", {})
    for word in [path, *words]:
        assert word in str(error.value)


def test_lora_rank_zero_is_refused(tmp_path):
    from sp_runtime.lora.files import read_lora_file
    path = str(tmp_path / "rank0.safetensors")
    save_file({"m.lora_up.weight": torch.zeros(8, 0), "m.lora_down.weight": torch.zeros(0, 8),
               "m.alpha": torch.tensor(1.0)}, path)
    with pytest.raises(ValueError, match="rank 0") as error:
        read_lora_file(path).adapters[0].scale
    assert path in str(error.value)


@pytest.fixture(scope="module")
def flux_original(tmp_path_factory):
    from safetensors.torch import load_file
    from sp_lab.tiny_models import write_tiny_checkpoint
    path = write_tiny_checkpoint("flux", str(tmp_path_factory.mktemp("flux") / "flux.safetensors"))
    return load_file(path)


def test_integer_weights_are_refused(flux_original, tmp_path):
    from sp_runtime.families import flux
    path = str(tmp_path / "int.safetensors")
    save_file({**flux_original, "img_in.weight": flux_original["img_in.weight"].to(torch.int32)}, path)
    with pytest.raises(ValueError, match="'img_in.weight' holds integers .*torch.int32") as error:
        flux.load_model(path)
    assert path in str(error.value)


@pytest.mark.parametrize("marker", [torch.zeros(0, dtype=torch.float8_e4m3fn), torch.zeros(2)])
def test_stray_scaled_fp8_marker_loads_the_file_as_it_is(flux_original, tmp_path, marker):
    """ComfyUI's convert_old_quants quantizes only layers with a `.scale_weight`: a marker without any is ignored."""
    from sp_runtime.families import flux
    path = str(tmp_path / "marked.safetensors")
    save_file({**flux_original, "scaled_fp8": marker}, path)
    assert _load_request(path, "default", {}).dtype == "float32"
    model, _, dtypes = flux.load_model(path)
    assert dtypes.quant is None and dtypes.storage == torch.float32
    assert torch.equal(model.x_embedder.weight, flux_original["img_in.weight"])


def test_flux2_folder_reads_its_own_config(tmp_path):
    from diffusers import Flux2Transformer2DModel
    from sp_runtime.families import flux2
    from sp_lab.tiny_models import write_tiny_checkpoint
    folder = write_tiny_checkpoint("flux2", str(tmp_path / "flux2"), "diffusers_folder",
                                   timestep_guidance_channels=64)
    model = flux2.load_model(folder)[0]
    reference = Flux2Transformer2DModel.from_pretrained(folder)
    assert model.config.timestep_guidance_channels == 64
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
