"""Checkpoint detection from the safetensors header alone: every file kind users have is classified right
(family, variant, key layout, prefix, architecture), and bad files fail with errors that say what is wrong."""
from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors.torch import save_file

from sp_runtime.checkpoints import loading as checkpoint
from sp_runtime.detection import detect
from sp_runtime.checkpoints.header import read_checkpoint_header
from sp_runtime.sp.tokens import TokenGrid, grid_ids, reference_placements, rope_axes
from sp_lab.tiny_models import COMFY_PREFIX, tiny_config, write_tiny_checkpoint

QWEN = {key: value for key, value in tiny_config("qwen_image").items()}
FLUX = {key: value for key, value in tiny_config("flux").items()}
FLUX["out_channels"] = 64  # diffusers' None means "as in_channels"; detection states it

# name -> (write_tiny_checkpoint arguments, expected family, variant, layout, prefix, config changes)
KINDS = {
    "qwen_original": (dict(family="qwen_image"), "qwen_image", "image", "diffusers", "", {}),
    "qwen_comfy_prefix": (dict(family="qwen_image", prefix=COMFY_PREFIX), "qwen_image", "image", "diffusers",
                          COMFY_PREFIX, {}),
    "qwen_other_prefix": (dict(family="qwen_image", prefix="diffusion_model."), "qwen_image", "image",
                          "diffusers", "diffusion_model.", {}),
    "qwen_fp8": (dict(family="qwen_image", dtype="float8_e4m3fn", prefix=COMFY_PREFIX), "qwen_image", "image",
                 "diffusers", COMFY_PREFIX, {}),
    "qwen_edit_2511": (dict(family="qwen_image", variant="edit_2511"), "qwen_image", "edit_2511", "diffusers", "",
                       {"zero_cond_t": True}),
    "qwen_folder": (dict(family="qwen_image", layout="diffusers_folder", max_shard_size="100KB"), "qwen_image",
                    "image", "diffusers", "", {}),
    "qwen_folder_2511": (dict(family="qwen_image", layout="diffusers_folder", variant="edit_2511"), "qwen_image",
                         "edit_2511", "diffusers", "", {"zero_cond_t": True}),
    "flux_original": (dict(family="flux"), "flux", "dev", "original", "", {}),
    "flux_comfy_prefix": (dict(family="flux", prefix=COMFY_PREFIX, dtype="bfloat16"), "flux", "dev", "original",
                          COMFY_PREFIX, {}),
    "flux_fp8_e5m2": (dict(family="flux", dtype="float8_e5m2"), "flux", "dev", "original", "", {}),
    "flux_schnell": (dict(family="flux", variant="schnell"), "flux", "schnell", "original", "",
                     {"guidance_embeds": False}),
    "flux_fill": (dict(family="flux", variant="fill"), "flux", "fill", "original", "", {"in_channels": 384}),
    "flux_diffusers_file": (dict(family="flux", layout="diffusers"), "flux", "dev", "diffusers", "", {}),
    "flux_diffusers_prefixed": (dict(family="flux", layout="diffusers", prefix="transformer."), "flux", "dev",
                                "diffusers", "transformer.", {}),
    "flux_folder": (dict(family="flux", layout="diffusers_folder", max_shard_size="200KB"), "flux", "dev",
                    "diffusers", "", {}),
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kinds")
    paths = {}
    for name, (arguments, *_rest) in KINDS.items():
        arguments = dict(arguments)
        family = arguments.pop("family")
        suffix = "" if arguments.get("layout") == "diffusers_folder" else ".safetensors"
        paths[name] = write_tiny_checkpoint(family, str(folder / (name + suffix)), **arguments)
    return paths


@pytest.mark.parametrize("name", sorted(KINDS))
def test_every_kind_is_classified(written, name):
    _, family, variant, layout, prefix, changes = KINDS[name]
    found = detect(written[name])
    assert (found.family, found.variant, found.layout, found.prefix) == (family, variant, layout, prefix)
    expected = {**(QWEN if family == "qwen_image" else FLUX), **changes}
    if name == "flux_fill":
        expected["out_channels"] = 64
    assert {key: found.config[key] for key in expected} == {key: _as_found(value) for key, value in expected.items()}
    assert found.files and all(os.path.isfile(f) for f in found.files)


def _as_found(value):
    return tuple(value) if isinstance(value, list) else value


def test_sharded_folder_lists_every_shard(written):
    found = detect(written["qwen_folder"])
    assert len(found.files) > 1, "the folder was written with small shards"
    assert os.path.isfile(os.path.join(written["qwen_folder"], "diffusion_pytorch_model.safetensors.index.json"))


def test_pipeline_folder_resolves_to_its_transformer(tmp_path):
    write_tiny_checkpoint("flux", str(tmp_path / "pipeline" / "transformer"), layout="diffusers_folder")
    assert detect(str(tmp_path / "pipeline")).family == "flux"


def test_fp8_file_keeps_fp8_storage_by_default(written):
    header = read_checkpoint_header(written["qwen_fp8"])
    dtypes = checkpoint.choose_dtypes("default", header, COMFY_PREFIX)
    assert (dtypes.storage, dtypes.compute) == (torch.float8_e4m3fn, torch.bfloat16)
    assert checkpoint.choose_dtypes("bf16", header).storage == torch.bfloat16
    fp32 = read_checkpoint_header(written["qwen_original"])
    assert checkpoint.choose_dtypes("default", fp32) == checkpoint.WeightDtypes(torch.float32, torch.float32)
    assert checkpoint.choose_dtypes("float8_e5m2", fp32).layerwise


def test_detection_reads_no_weights(written, tmp_path):
    """Only the header is read: a file whose weight bytes are garbage is still classified."""
    data = bytearray(open(written["flux_comfy_prefix"], "rb").read())
    header_end = 8 + struct.unpack("<Q", bytes(data[:8]))[0]
    data[header_end:] = b"\xff" * (len(data) - header_end)
    path = tmp_path / "garbage_weights.safetensors"
    path.write_bytes(bytes(data))
    assert detect(str(path)).config == detect(written["flux_comfy_prefix"]).config


# ---------------------------------------------------------------------------------------------------------------
# Bad files

def test_truncated_file(written, tmp_path):
    data = open(written["flux_original"], "rb").read()
    path = tmp_path / "truncated.safetensors"
    path.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(ValueError, match="truncated"):
        detect(str(path))


def test_non_checkpoint(tmp_path):
    path = tmp_path / "notes.safetensors"
    path.write_text("these are not weights, just a text file that happens to be long enough")
    with pytest.raises(ValueError, match="not a safetensors checkpoint"):
        detect(str(path))
    tiny = tmp_path / "tiny.safetensors"
    tiny.write_bytes(b"abc")
    with pytest.raises(ValueError, match="not a safetensors checkpoint"):
        detect(str(tiny))


def test_pickled_checkpoint_is_refused(tmp_path):
    path = tmp_path / "model.ckpt"
    torch.save({"weight": torch.zeros(2)}, str(path))
    with pytest.raises(ValueError, match="pickled"):
        detect(str(path))


def test_missing_path_and_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        detect(str(tmp_path / "absent.safetensors"))
    (tmp_path / "weights").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        detect(str(tmp_path / "weights"))


def test_unsupported_family_names_it_and_lists_supported(tmp_path):
    path = tmp_path / "hunyuanimage2.1.safetensors"
    save_file({"model.diffusion_model.byt5_in.fc1.weight": torch.zeros(6, 2),
               "model.diffusion_model.img_in.proj.weight": torch.zeros(2, 2)}, str(path))
    with pytest.raises(ValueError) as error:
        detect(str(path))
    message = str(error.value)
    assert "looks like HunyuanImage 2.1" in message and "Qwen-Image" in message and "Flux.1" in message


@pytest.mark.parametrize("name, keys, kind", [
    # Flux.3 (the templates' flux3-image-klein files) by the key diffusers' single-file loader detects it by
    ("flux3-image-klein-int8-convrot", ("early_stream_modulations.image.lin.weight", "ref_time_in.in_layer.weight"),
     "Flux.3"),
    ("fibo2_dev_int8_convrot", ("perceiver.latent_queries", "noise_refiner.0.attention.to_q.weight"), "Bria FIBO 2"),
    # ComfyUI's model_detection keys of the templates' other new architectures (comfy/ldm/<name>, ComfyUI 0.33)
    ("pid_flux1_1024_to_4096_4step_bf16", ("lq_proj.latent_proj.0.weight", "lq_proj.gate_modules.0.content_proj.weight",
                                           "core.pixel_embedder.proj.weight"), "PiD"),
    ("pixeldit_1300m_1024px_bf16", ("core.pixel_embedder.proj.weight", "core.blocks.0.attn.qkv_x.weight"), "PixelDiT")])
def test_template_models_without_a_family_are_refused_by_name(name, keys, kind):
    from sp_runtime.checkpoints.header import Header
    header = Header(f"{name}.safetensors", {f"model.diffusion_model.{key}": ("BF16", (9, 3)) for key in keys})
    with pytest.raises(ValueError, match=f"looks like {kind} "):
        detect(header)


def test_unknown_tensors_are_summarised(tmp_path):
    path = tmp_path / "mystery.safetensors"
    save_file({"encoder.layer.0.weight": torch.zeros(2, 2), "encoder.layer.1.weight": torch.zeros(2, 2),
               "head.weight": torch.zeros(2)}, str(path))
    with pytest.raises(ValueError, match=r"3 tensors.*encoder \(2\)"):
        detect(str(path))


def test_bitsandbytes_files_are_refused(tmp_path):
    nf4 = tmp_path / "flux_nf4.safetensors"
    write_tiny_checkpoint("flux", str(nf4))
    _add_tensor(str(nf4), "double_blocks.0.img_attn.qkv.weight.absmax", torch.ones(4))
    with pytest.raises(ValueError, match="bitsandbytes"):
        detect(str(nf4))


def _add_tensor(path: str, name: str, tensor: torch.Tensor) -> None:
    from safetensors.torch import load_file
    state = load_file(path)
    state[name] = tensor
    save_file(state, path)


def test_header_length_beyond_file(tmp_path):
    path = tmp_path / "bad_header.safetensors"
    path.write_bytes(struct.pack("<Q", 10 ** 6) + json.dumps({}).encode())
    with pytest.raises(ValueError, match="header length"):
        detect(str(path))


# ---------------------------------------------------------------------------------------------------------------
# Facts detection and the forward rely on, checked against ComfyUI's formulas written out by hand

def test_rope_axes_match_the_real_models():
    assert rope_axes(128) == (16, 56, 56)
    for head_dim in (8, 16, 32, 64, 96):
        axes = rope_axes(head_dim)
        assert sum(axes) == head_dim and all(a % 2 == 0 and a > 0 for a in axes)


def test_position_ids_follow_comfyui():
    # Qwen-Image centres: h_len 5 -> rows -2..2 (linspace(0, 4) - 5 // 2); w_len 4 -> cols -2..1
    ids = grid_ids(TokenGrid.of(9, 8, 2), 0, 0, 0, True, torch.float32, torch.device("cpu")).reshape(5, 4, 3)
    assert ids[:, 0, 1].tolist() == [-2, -1, 0, 1, 2] and ids[0, :, 2].tolist() == [-2, -1, 0, 1]
    # Flux: offsets in latent pixels become (offset + 1) // 2 tokens, index on axis 0
    ids = grid_ids(TokenGrid.of(4, 6, 2), 1, 5, 2, False, torch.float32, torch.device("cpu")).reshape(2, 3, 3)
    assert ids[..., 0].unique().tolist() == [1]
    assert ids[:, 0, 1].tolist() == [3, 4] and ids[0, :, 2].tolist() == [1, 2, 3]


def test_reference_placements_follow_comfyui():
    refs = [(6, 10), (8, 4), (5, 5)]
    # "offset" (ComfyUI): below the others unless that makes the stack taller than wide, then to the right
    assert reference_placements("offset", (8, 8), refs, 2, ("index",)) == [(1, 0, 0), (1, 6, 0), (1, 0, 10)]
    assert reference_placements("index", (8, 8), refs, 2, ("index",)) == [(1, 0, 0), (2, 0, 0), (3, 0, 0)]
    assert reference_placements("uxo", (8, 6), refs[:2], 2, ("uxo",)) == [(0, 8, 6), (0, 14, 16)]
    assert reference_placements("negative_index", (8, 8), refs[:2], 2, ("negative_index",)) == [(-1, 0, 0),
                                                                                                (-2, 0, 0)]
    assert reference_placements("uxo", (8, 8), refs[:1], 2, ("index",)) == [(1, 0, 0)]  # unknown -> offset


def test_token_rectangles_cover_ranges_exactly():
    grid = TokenGrid.of(9, 13, 2)  # 5 x 7 tokens
    for first in range(grid.count):
        for stop in range(first, grid.count + 1):
            blocks = grid.rectangles(first, stop)
            assert len(blocks) <= 3
            covered = [r * grid.cols + c for r0, r1, c0, c1 in blocks for r in range(r0, r1) for c in range(c0, c1)]
            assert covered == list(range(first, stop))


@pytest.mark.parametrize("family_module, wrong_family, what", [
    ("flux", "qwen_image", "Flux.1"), ("qwen_image", "flux", "Qwen-Image"), ("wan", "flux", "Wan")])
def test_a_family_loader_refuses_another_familys_file(tmp_path, family_module, wrong_family, what):
    import importlib
    path = write_tiny_checkpoint(wrong_family, str(tmp_path / "other.safetensors"))
    load_model = importlib.import_module(f"sp_runtime.families.{family_module}").load_model
    with pytest.raises(ValueError, match=f"other.safetensors.*is not a {what} checkpoint"):
        load_model(path)
