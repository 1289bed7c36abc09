"""Wan detection from the header alone: every tiny checkpoint kind (layouts, prefixes, variants, dtypes, folders) and
the full-size headers of the released models are classified right, and Wan files we cannot run fail clearly."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from sp_runtime.families import wan
from sp_runtime.checkpoints.header import Header, read_checkpoint_header
from sp_runtime.detection import detect
from sp_runtime.families.wan.detect import HEAD_DIM_METADATA_KEY, detect as detect_header
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint
from sp_lab.tiny_models.wan import build_tiny_model, original_state_dict, tiny_config

# name -> (write_tiny_checkpoint arguments, variant, layout, prefix)
KINDS = {
    "t2v": (dict(), "t2v", "original", ""),
    "t2v_comfy_prefix": (dict(prefix=COMFY_PREFIX), "t2v", "original", COMFY_PREFIX),
    "t2v_other_prefix": (dict(prefix="diffusion_model."), "t2v", "original", "diffusion_model."),
    "t2v_bf16": (dict(dtype="bfloat16"), "t2v", "original", ""),
    "t2v_fp8": (dict(dtype="float8_e4m3fn", prefix=COMFY_PREFIX), "t2v", "original", COMFY_PREFIX),
    "i2v": (dict(variant="i2v"), "i2v", "original", ""),
    "flf2v": (dict(variant="flf2v", prefix=COMFY_PREFIX), "flf2v", "original", COMFY_PREFIX),
    "i2v_concat": (dict(variant="i2v_concat"), "i2v_concat", "original", ""),
    "ti2v": (dict(variant="ti2v", dtype="float16"), "ti2v", "original", ""),
    "t2v_diffusers_file": (dict(layout="diffusers"), "t2v", "diffusers", ""),
    "i2v_diffusers_prefixed": (dict(layout="diffusers", variant="i2v", prefix="transformer."), "i2v", "diffusers",
                               "transformer."),
    "flf2v_folder": (dict(layout="diffusers_folder", variant="flf2v", max_shard_size="300KB"), "flf2v",
                     "diffusers", ""),
    "ti2v_folder": (dict(layout="diffusers_folder", variant="ti2v"), "ti2v", "diffusers", ""),
    "vace_comfy_prefix": (dict(variant="vace", prefix=COMFY_PREFIX), "vace", "original", COMFY_PREFIX),
    "vace_folder": (dict(layout="diffusers_folder", variant="vace"), "vace", "diffusers", ""),
    "fun_control": (dict(variant="fun_control"), "fun_control", "original", ""),
    "camera_comfy_prefix": (dict(variant="camera", prefix=COMFY_PREFIX), "camera", "original", COMFY_PREFIX),
    "camera_2.2": (dict(variant="camera_2.2"), "camera_2.2", "original", ""),
    "humo_comfy_prefix": (dict(variant="humo", prefix=COMFY_PREFIX), "humo", "original", COMFY_PREFIX),
    "s2v": (dict(variant="s2v"), "s2v", "original", ""),
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wan_kinds")
    paths = {}
    for name, (arguments, *_rest) in KINDS.items():
        suffix = "" if arguments.get("layout") == "diffusers_folder" else ".safetensors"
        paths[name] = write_tiny_checkpoint("wan", str(folder / (name + suffix)), **arguments)
    return paths


@pytest.mark.parametrize("name", sorted(KINDS))
def test_every_kind_is_classified(written, name):
    arguments, variant, layout, prefix = KINDS[name]
    found = detect(written[name])
    assert (found.family, found.variant, found.layout, found.prefix) == ("wan", variant, layout, prefix)
    expected = tiny_config(variant)
    assert {key: found.config[key] for key in expected} == expected
    assert found.files and all(os.path.isfile(f) for f in found.files)
    if arguments.get("max_shard_size"):
        assert len(found.files) > 1


# ---------------------------------------------------------------------------------------------------------------
# Full-size headers of the released models (shapes only; no file, no weights)

RELEASED = {  # name -> (diffusers config of the release, expected variant)
    "Wan2.1 T2V 1.3B": (dict(num_attention_heads=12, ffn_dim=8960, num_layers=30), "t2v"),
    "Wan2.1 T2V 14B / Wan2.2 T2V A14B expert": (dict(num_attention_heads=40, ffn_dim=13824, num_layers=40), "t2v"),
    "Wan2.1 I2V 14B 480p/720p": (dict(num_attention_heads=40, ffn_dim=13824, num_layers=40, in_channels=36,
                                      image_dim=1280, added_kv_proj_dim=5120), "i2v"),
    "Wan2.1 FLF2V 14B": (dict(num_attention_heads=40, ffn_dim=13824, num_layers=40, in_channels=36, image_dim=1280,
                              added_kv_proj_dim=5120, pos_embed_seq_len=514), "flf2v"),
    "Wan2.2 I2V A14B expert": (dict(num_attention_heads=40, ffn_dim=13824, num_layers=40, in_channels=36),
                               "i2v_concat"),
    "Wan2.2 TI2V 5B": (dict(num_attention_heads=24, ffn_dim=14336, num_layers=30, in_channels=48, out_channels=48),
                       "ti2v"),
}


def _released_state(config: dict) -> dict:
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel
    with init_empty_weights():
        return WanTransformer3DModel(attention_head_dim=128, **config).state_dict()


def _header(state: dict, prefix: str = "", dtype: str = "BF16") -> Header:
    return Header("released.safetensors", {prefix + key: (dtype, tuple(value.shape)) for key, value in
                                           state.items()})


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_released_models_are_classified(name):
    config, variant = RELEASED[name]
    state = _released_state(config)
    for header, layout in ((_header(original_state_dict_of(state), COMFY_PREFIX), "original"),
                           (_header(state, dtype="F8_E4M3"), "diffusers")):
        found = detect_header(header)
        assert (found.family, found.variant, found.layout) == ("wan", variant, layout)
        built = wan.model_config(found)
        assert built["attention_head_dim"] == 128
        for key, value in config.items():
            assert built[key] == value, (key, built[key], value)


def original_state_dict_of(state: dict) -> dict:
    class Holder(torch.nn.Module):
        def state_dict(self, *args, **kwargs):
            return state
    return original_state_dict(Holder())


# ---------------------------------------------------------------------------------------------------------------
# Head size sources and errors

def test_original_release_folder_states_its_head_size(tmp_path):
    """The original Wan-AI folders: original key names, config.json of class WanModel with dim and num_heads."""
    model = build_tiny_model(0)
    folder = tmp_path / "Wan2.1-T2V-tiny"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in original_state_dict(model).items()},
              str(folder / "diffusion_pytorch_model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"_class_name": "WanModel", "dim": 96, "num_heads": 6,
                                                     "model_type": "t2v"}))
    found = detect(str(folder))
    assert (found.layout, found.variant, found.config["attention_head_dim"]) == ("original", "t2v", 16)
    loaded = wan.load_model(str(folder))[0]
    assert loaded.config.num_attention_heads == 6


def test_head_size_defaults_to_128_and_metadata_states_tiny_ones(tmp_path):
    path = write_tiny_checkpoint("wan", str(tmp_path / "meta.safetensors"))
    assert read_checkpoint_header(path).metadata[HEAD_DIM_METADATA_KEY] == "16"
    bare = write_tiny_checkpoint("wan", str(tmp_path / "bare.safetensors"), head_dim_metadata=False)
    assert detect(bare).config["attention_head_dim"] is None  # 96 wide: 128 does not divide it
    wide = write_tiny_checkpoint("wan", str(tmp_path / "wide.safetensors"), head_dim_metadata=False,
                                 num_attention_heads=2, attention_head_dim=64)
    assert (detect(wide).config["attention_head_dim"], detect(wide).config["num_attention_heads"]) == (128, 1)


# ---------------------------------------------------------------------------------------------------------------
# Files that must fail clearly

def _tiny_original(**extra) -> dict:
    return {**{k: v.contiguous() for k, v in original_state_dict(build_tiny_model(0)).items()}, **extra}


@pytest.mark.parametrize("extra, message", [
    ({"casual_audio_encoder.encoder.final_linear.weight": torch.zeros(2, 2)},
     "this Wan S2V checkpoint has 0 audio injectors and 0 adaptive norms"),
    ({"face_adapter.fuser_blocks.0.k_norm.weight": torch.zeros(2)}, "no tensor 'pose_patch_embedding.weight'"),
    ({"blocks.0.self_attn.lora_down.weight": torch.zeros(2, 2)},
     r"modules this loader does not know: blocks\.\*\.self_attn\.lora_down \(1 tensors\)"),
    ({f"blocks.{b}.motion_adapter.proj.{kind}": torch.zeros(2) for b in range(2) for kind in ("weight", "bias")}
     | {"style_encoder.weight": torch.zeros(2)},
     r"has modules this loader does not know: blocks\.\*\.motion_adapter\.proj, style_encoder \(5 tensors\)"),
    ({"blocks.0.self_attn.q.comfy_quant": torch.tensor(list(b'{"format": "awq_w4a16"}'), dtype=torch.uint8)},
     "'awq_w4a16', which is not supported; supported ComfyUI formats: scaled fp8, float8_e4m3fn"),
])
def test_unsupported_wan_files_fail_clearly(tmp_path, extra, message):
    path = str(tmp_path / "odd.safetensors")
    save_file(_tiny_original(**extra), path, metadata={HEAD_DIM_METADATA_KEY: "16"})
    with pytest.raises(ValueError, match=message):
        detect(path)


def test_other_wan_classes_in_folders_are_named(tmp_path):
    path = write_tiny_checkpoint("wan", str(tmp_path / "folder"), layout="diffusers_folder")
    config = json.loads((tmp_path / "folder" / "config.json").read_text())
    config["_class_name"] = "WanDancerTransformer3DModel"
    (tmp_path / "folder" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="is a WanDancerTransformer3DModel: only WanTransformer3DModel"):
        detect(path)


def test_other_families_are_not_taken_for_wan(tmp_path):
    path = write_tiny_checkpoint("flux", str(tmp_path / "flux.safetensors"))
    assert detect_header(read_checkpoint_header(path)) is None
    assert detect(path).family == "flux"


def test_the_base_imports_no_variant():
    """Wan's base modules (detection, key plan, loading, plan, host) never import a variant: each variant module
    registers a wan.variants.Variant, which the base reads."""
    import ast
    import pathlib
    from sp_runtime.families.wan.variants import REGISTRY
    folder = pathlib.Path(wan.__file__).parent
    variant_modules = {variant.check.__module__.rsplit(".", 1)[-1] for variant in REGISTRY if variant.check} | {
        variant.layout.__module__.rsplit(".", 1)[-1] for variant in REGISTRY if variant.layout}
    assert {"vace", "s2v", "humo", "animate", "animate2", "camera", "fun", "in_context", "scail"} <= variant_modules
    for base in ("detect", "keys", "load", "plan", "host", "variants"):
        tree = ast.parse((folder / f"{base}.py").read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1
                    for alias in node.names} | {node.module for node in ast.walk(tree)
                                                if isinstance(node, ast.ImportFrom) and node.level == 1}
        assert not imported & variant_modules, (base, imported & variant_modules)


def test_scail_files_are_told_apart_by_their_convs(tmp_path):
    """As ComfyUI's detection: patch_embedding_mask -> SCAIL-2, patch_embedding_pose alone -> SCAIL (Wan 2.1 I2V's
    other keys); the pose and mask input widths read from the header."""
    for variant, mask in (("scail2", 28), ("scail", None)):
        path = write_tiny_checkpoint("wan", str(tmp_path / f"{variant}.safetensors"), variant=variant,
                                     prefix=COMFY_PREFIX)
        found = detect(path)
        assert (found.family, found.variant, found.config["pose_in_channels"], found.config.get("mask_in_channels"),
                found.config["image_dim"]) == ("wan", variant, 20, mask, 1280)
