"""ComfyUI's model config for SP checkpoints from the safetensors header alone (nodes/comfy_model.py): the ComfyUI
model class ComfyUI itself would pick, for every layout and variant the families load, without reading weights.

Needs COMFYUI_PATH; skipped otherwise.
"""
import json

import pytest

import comfy_support as cs
from sp_runtime.checkpoints.header import read_checkpoint_header
from sp_runtime.families import FAMILIES, comfy_host

pytestmark = pytest.mark.skipif(cs.comfyui_path() is None, reason=cs.NO_COMFYUI)


@pytest.fixture(scope="module")
def comfy_model():
    cs.import_comfy()
    return cs.import_node_module("comfy_model")


class Info:
    """The parts of sp_runtime's ModelInfo that the config uses."""

    def __init__(self, family, variant="", in_channels=16, out_channels=16):
        self.family, self.variant = family, variant
        self.in_channels, self.out_channels = in_channels, out_channels


CASES = [  # (family, write_tiny options, our variant, ComfyUI class, (unet_config key, value) in ComfyUI's convention)
    ("qwen_image", {}, "image", "QwenImage", ("in_channels", 64)),
    ("qwen_image", {"layout": "diffusers"}, "image", "QwenImage", ("in_channels", 64)),
    ("qwen_image", {"prefix": "model.diffusion_model."}, "image", "QwenImage", ("in_channels", 64)),
    ("flux", {}, "dev", "Flux", ("in_channels", 16)),
    ("flux", {"layout": "diffusers"}, "dev", "Flux", ("in_channels", 16)),
    ("flux", {"variant": "schnell"}, "schnell", "FluxSchnell", ("in_channels", 16)),
    ("flux", {"variant": "fill"}, "fill", "FluxInpaint", ("in_channels", 96)),
    ("wan", {}, "t2v", "WAN21_T2V", ("in_dim", 16)),
    ("wan", {"variant": "i2v"}, "i2v", "WAN21_I2V", ("in_dim", 36)),
    ("wan", {"variant": "i2v_concat"}, "i2v_concat", "WAN21_T2V", ("in_dim", 36)),
    ("wan", {"variant": "ti2v"}, "ti2v", "WAN22_T2V", ("out_dim", 48)),
    ("wan", {"variant": "s2v", "prefix": "model.diffusion_model."}, "s2v", "WAN22_S2V", ("in_dim", 16)),
]
CHANNELS = {("qwen_image", "image"): (16, 16), ("flux", "fill"): (96, 16), ("wan", "i2v"): (36, 16),
            ("wan", "i2v_concat"): (36, 16), ("wan", "ti2v"): (48, 48)}  # our ModelInfo's (in, out); else 16, 16


@pytest.mark.parametrize("family, options, variant, expected, unet_entry", CASES)
def test_comfy_model_class_from_header(comfy_model, tmp_path, family, options, variant, expected, unet_entry):
    import comfy.supported_models
    path = cs.write_tiny(family, str(tmp_path), **options)
    info = Info(family, variant, *CHANNELS.get((family, variant), (16, 16)))
    key, value = unet_entry
    config = comfy_model.comfy_model_config(read_checkpoint_header(path), info)
    assert type(config) is getattr(comfy.supported_models, expected)
    assert config.unet_config[key] == value
    # the same class and channels from our own detection alone (the path for files ComfyUI does not recognise)
    ours = comfy_model.config_from_info(info)
    assert type(ours) is type(config) and ours.unet_config[key] == value


def test_meta_state_dict_reads_no_weights(comfy_model, tmp_path):
    import torch
    path = cs.write_tiny("flux", str(tmp_path))
    state = comfy_model.meta_state_dict(read_checkpoint_header(path))
    assert state and all(tensor.device.type == "meta" for tensor in state.values())
    assert state["img_in.weight"].shape == (96, 64) and state["img_in.weight"].dtype == torch.float32


def test_model_without_comfy_class_is_a_clear_error(comfy_model, tmp_path):
    from safetensors.torch import save_file
    import torch
    path = str(tmp_path / "toy.safetensors")
    save_file({"w": torch.zeros(2)}, path, metadata={"ulysses_sp.family": "toy", "ulysses_sp.config": json.dumps({})})
    with pytest.raises(ValueError, match="family 'toy'.*no ComfyUI model class.*supported families: ") as error:
        comfy_model.comfy_model_config(read_checkpoint_header(path), Info("toy"))
    named = str(error.value).split("supported families: ")[1].split(", ")
    # every registered family with a ComfyUI host, sorted (the list grows with each family added)
    assert named == sorted(family for family in FAMILIES if comfy_host(family))
    assert {"chroma", "flux", "flux2", "hunyuan_video", "qwen_image", "sd3", "wan", "z_image"} <= set(named)
    assert "toy" not in named


@pytest.mark.parametrize("family, name, channels", [("flux2", "Flux2", 16), ("qwen_image21", "QwenImage21", 16),
                                                   ("z_image", "ZImage", 16), ("ltx2", "LTXAV", 1),
                                                   ("hidream_o1", "HiDreamO1", 3)])
def test_families_newer_than_this_comfyui_name_the_class_they_need(comfy_model, tmp_path, family, name, channels):
    """Flux.2, Qwen-Image 2.1, Z-Image and LTX-2 need a newer ComfyUI than some users run: a clear error there, the class where
    ComfyUI has it."""
    import comfy.supported_models
    path = cs.write_tiny(family, str(tmp_path))
    info = Info(family, "", channels, channels)
    if not hasattr(comfy.supported_models, name):
        with pytest.raises(ValueError, match=f"supported_models.{name}.*update ComfyUI"):
            comfy_model.comfy_model_config(read_checkpoint_header(path), info)
    else:
        assert type(comfy_model.comfy_model_config(read_checkpoint_header(path), info)).__name__ == name


def test_sp_model_building_keeps_comfys_sampling_settings(comfy_model, tmp_path):
    import torch
    path = cs.write_tiny("flux", str(tmp_path), variant="schnell")
    config = comfy_model.comfy_model_config(read_checkpoint_header(path), Info("flux", "schnell"))
    proxy = torch.nn.Module()
    proxy.dtype = torch.bfloat16
    proxy.weight_shapes = comfy_model.weight_shapes(read_checkpoint_header(path))
    model = comfy_model.build_sp_model(config, proxy, torch.bfloat16)
    assert model.model.diffusion_model is proxy and model.model_dtype() == torch.bfloat16
    unet = model.model.model_config.unet_config  # what ComfyUI's Flux LoRA key map reads: the file's sizes
    assert (unet["hidden_size"], unet["depth"], unet["depth_single_blocks"]) == (96, 2, 2)
    assert model.get_model_object("model_sampling").shift == 1.0  # schnell: ComfyUI's own sampling settings
    shape = [2, 16, 1, 512, 512]  # a 4096^2 image, cond + uncond
    host_bytes = model.model.memory_required(shape)
    assert host_bytes == 8 * 4 * 2 * 16 * 512 * 512  # a few float32 latents: ComfyUI keeps the CFG batch whole


def test_weight_shapes_are_comfys_names_for_every_layout(comfy_model, tmp_path):
    """ComfyUI's names and shapes of the weights, whatever the file's layout: what its LoRA key matching needs."""
    original = comfy_model.weight_shapes(read_checkpoint_header(cs.write_tiny("flux", str(tmp_path))))
    diffusers = comfy_model.weight_shapes(read_checkpoint_header(cs.write_tiny("flux", str(tmp_path),
                                                                               layout="diffusers")))
    assert original["double_blocks.0.img_attn.qkv.weight"] == (288, 96)
    assert diffusers == original
