"""Z-Image, Qwen-Image-Layered and Flux.2 against ComfyUI's own code (needs COMFYUI_PATH; each family skips, naming
the class and the ComfyUI version it needs, where the ComfyUI found lacks it): the pool at degrees 1-4 equals
ComfyUI's network (NextDiT with Z-Image's options, QwenImageTransformer2DModel with additional_t_cond, Flux with
Flux.2's parameters) holding the same tiny file's weights, on the cases of each family's own test module; and ComfyUI's
detection (comfy.model_detection) of the files gives the configuration ours gives. ComfyUI's networks are built from
what its detection says of the file, or of a released-size header where its detection knows only real sizes."""
from __future__ import annotations

import importlib
import inspect

import pytest
import torch

import comfy_support as cs
from family_support import assert_parity
from sp_runtime.families import flux2, qwen_image, z_image
from sp_runtime.checkpoints.header import Header, read_checkpoint_header
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint
from test_flux2 import SEED as FLUX2_SEED, make_cases as flux2_cases
from test_qwen_image_layered import SEED as LAYERED_SEED, SIZE as LAYERED_SIZE, make_cases as layered_cases
from test_z_image import SEED as Z_IMAGE_SEED, real_size_keys, make_cases as z_image_cases

pytestmark = pytest.mark.skipif(cs.comfyui_path() is None, reason=cs.NO_COMFYUI)
pytest_plugins = ["family_pools"]  # the shared per-degree worker pools

# name -> (ComfyUI module, class, the constructor argument only versions with the model have, first such release)
NEEDS = {"z_image": ("comfy.ldm.lumina.model", "NextDiT", "z_image_modulation", "0.3.74"),
         "layered": ("comfy.ldm.qwen_image.model", "QwenImageTransformer2DModel", "use_additional_t_cond", "0.6.0"),
         "flux2": ("comfy.ldm.flux.model", "FluxParams", "global_modulation", "0.3.72")}


def comfy_class(name: str):
    """ComfyUI's class for the model; None where the ComfyUI found lacks it (or none is set)."""
    if cs.comfyui_path() is None:
        return None
    module_name, class_name, argument, _ = NEEDS[name]
    cs.import_comfy()
    found = getattr(importlib.import_module(module_name), class_name, None)
    return found if found is not None and argument in inspect.signature(found).parameters else None


def needs(name: str):
    """Skips the test (at collection, before any pool starts) where the ComfyUI found lacks the model's class."""
    module_name, class_name, argument, version = NEEDS[name]
    return pytest.mark.skipif(cs.comfyui_path() is not None and comfy_class(name) is None,
                              reason=f"ComfyUI at {cs.comfyui_path()} has no {module_name}.{class_name}"
                                     f"({argument}=...); needs ComfyUI >= {version}")


def comfy_detection(state: dict, prefix: str = COMFY_PREFIX) -> dict:
    """What ComfyUI's own detection says of a state dict (meta tensors: no weight read)."""
    import comfy.model_detection
    return comfy.model_detection.detect_unet_config(state, prefix)


def meta_state(header: Header) -> dict:
    return cs.import_node_module("comfy_model").meta_state_dict(header)


def load_comfy_weights(network: torch.nn.Module, path: str, allowed_missing=()) -> torch.nn.Module:
    """The file's weights in ComfyUI's network, prefix dropped; only `allowed_missing` may stay unset. Newer ComfyUI
    names the QK norms' weight `.weight` where files say `.scale` (its Flux config renames them on load)."""
    import comfy.utils
    state = comfy.utils.state_dict_prefix_replace(comfy.utils.load_torch_file(path), {COMFY_PREFIX: ""},
                                                  filter_keys=True)
    wanted = network.state_dict().keys()
    state = {key if key in wanted else key.replace("_norm.scale", "_norm.weight"): value
             for key, value in state.items()}
    missing, unexpected = network.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= set(allowed_missing), (missing, unexpected)
    return network.eval()


def comfy_settings() -> dict:
    import comfy.ops
    return dict(operations=comfy.ops.disable_weight_init, dtype=torch.float32, device="cpu")


def comfy_outputs(network, cases: dict, call) -> dict:
    with torch.no_grad():
        return {name: call(network, x, t, inputs) for name, (x, t, inputs) in cases.items()}


def check_pool(pool, path: str, cases: dict, expected: dict, what: str) -> None:
    handle = pool.load_model(path)
    for name, (x, t, inputs) in cases.items():
        assert_parity(handle(x, t, **inputs), expected[name], "float32", f"{what}/{name}")
    handle.unload()


# ---------------------------------------------------------------------------------------------------------------
# Z-Image: ComfyUI's NextDiT

# ComfyUI's timestep embedder is min(dim, 1024) wide, diffusers' 1024 at any width: they agree from 1024 on (the
# released model is 3840 wide), so this tiny Z-Image has 9 heads of 128 (neither 2 nor 4 divides them)
Z_IMAGE_COMFY_SIZE = dict(dim=1152, n_heads=9)


@pytest.fixture(scope="module")
def z_image_comfy(tmp_path_factory):
    """(file, ComfyUI's outputs): NextDiT with the Z-Image entries ComfyUI's detection gives a released file, at the
    tiny model's sizes."""
    path = write_tiny_checkpoint("z_image", str(tmp_path_factory.mktemp("z_image_comfy") / "z.safetensors"),
                                 seed=Z_IMAGE_SEED, prefix=COMFY_PREFIX, **Z_IMAGE_COMFY_SIZE)
    network = z_image_comfy_network(path)

    def call(net, x, t, inputs):
        context = inputs["context"]
        return net(x, t, context, inputs.get("num_tokens", context.shape[1]),
                   attention_mask=inputs.get("attention_mask"), transformer_options={})
    return path, comfy_outputs(network, z_image_cases(), call)


def z_image_comfy_network(path: str):
    """ComfyUI's NextDiT with the Z-Image entries its detection gives a released file, at the sizes of the tiny
    file at `path`, holding its weights."""
    released = comfy_detection(meta_state(Header("z_image_turbo_bf16.safetensors", real_size_keys(True))), "")
    ours = z_image.detect(read_checkpoint_header(path)).config
    tiny = {key: ours[key] for key in ("dim", "n_layers", "n_refiner_layers", "n_heads", "n_kv_heads",
                                       "cap_feat_dim")}
    network = comfy_class("z_image")(**{**released, **tiny}, **comfy_settings())
    return load_comfy_weights(network, path, allowed_missing=("norm_final.weight",))  # unused by the forward


@needs("z_image")
def test_z_image_pool_equals_comfys_next_dit(family_pool, z_image_comfy):
    """ComfyUI's NextDiT normalises q and k with the dtype's epsilon, diffusers (as Z-Image's own code) with 1e-5,
    which the pool follows: 3.5e-6 of the output here (6.9e-8 with ComfyUI's epsilon set to 1e-5), within the bound."""
    path, expected = z_image_comfy
    check_pool(family_pool, path, z_image_cases(), expected, "comfyui_z_image")


@needs("z_image")
def test_z_image_comfy_detection_of_a_released_header_equals_ours():
    """ComfyUI knows Z-Image only at its released size (3840 wide): the header of one, read by both detections."""
    header = Header("z_image_turbo_bf16.safetensors",
                    {COMFY_PREFIX + key: value for key, value in real_size_keys(True).items()})
    theirs = comfy_detection(meta_state(header))
    ours = z_image.detect(header).config
    assert theirs["image_model"] == "lumina2" and theirs["z_image_modulation"]
    assert theirs["pad_tokens_multiple"] == 32  # ours: the pad tokens are required
    assert theirs["time_scale"] == ours["t_scale"]
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "cap_feat_dim", "rope_theta", "in_channels"):
        assert theirs[key] == ours[key], key
    assert list(theirs["axes_dims"]) == list(ours["axes_dims"]) and list(theirs["axes_lens"]) == list(
        ours["axes_lens"])
    assert theirs.get("n_refiner_layers", 2) == ours["n_refiner_layers"]  # ComfyUI's default: 2


# ---------------------------------------------------------------------------------------------------------------
# Qwen-Image-Layered: ComfyUI's QwenImageTransformer2DModel with additional_t_cond

@pytest.fixture(scope="module")
def layered_comfy(tmp_path_factory):
    """(file, ComfyUI's detection of it, ComfyUI's outputs)."""
    network_class = comfy_class("layered")
    path = write_tiny_checkpoint("qwen_image", str(tmp_path_factory.mktemp("layered_comfy") / "l.safetensors"),
                                 variant="layered", seed=LAYERED_SEED, prefix=COMFY_PREFIX, **LAYERED_SIZE)
    detected = comfy_detection(meta_state(read_checkpoint_header(path)))
    ours = qwen_image.detect(read_checkpoint_header(path)).config
    tiny = {key: ours[key] for key in ("attention_head_dim", "num_attention_heads", "joint_attention_dim",
                                       "out_channels", "axes_dims_rope")}
    network = load_comfy_weights(network_class(**detected, **tiny, **comfy_settings()), path)

    def call(net, x, t, inputs):
        return net(x, t, inputs["context"], transformer_options={},
                   **{key: value for key, value in inputs.items() if key != "context"})
    return path, detected, comfy_outputs(network, layered_cases(), call)


@needs("layered")
def test_layered_pool_equals_comfys_model(family_pool, layered_comfy):
    """Layer frames with and without the condition image, placed by ComfyUI's default for Layered or named."""
    path, _, expected = layered_comfy
    check_pool(family_pool, path, layered_cases(), expected, "comfyui_layered")


@needs("layered")
def test_layered_comfy_detection_equals_ours(layered_comfy):
    path, detected, _ = layered_comfy
    handle_config = qwen_image.load_model(path, "float32")[0].config
    detection = qwen_image.detect(read_checkpoint_header(path))
    assert detection.variant == "layered" and detected["image_model"] == "qwen_image"
    assert detected["use_additional_t_cond"] == detection.config["use_additional_t_cond"] is True
    assert detected["in_channels"] == detection.config["in_channels"]
    assert detected["num_layers"] == detection.config["num_layers"]
    assert detected["default_ref_method"] == qwen_image.default_ref_method(handle_config) == "negative_index"


# ---------------------------------------------------------------------------------------------------------------
# Flux.2: ComfyUI's Flux with Flux.2's parameters

@pytest.fixture(scope="module")
def flux2_comfy(tmp_path_factory):
    """{variant: (file, ComfyUI's detection, ComfyUI's outputs)} for dev (guidance) and klein."""
    import comfy.ldm.flux.model
    folder = tmp_path_factory.mktemp("flux2_comfy")
    out = {}
    for variant in ("dev", "klein"):
        path = write_tiny_checkpoint("flux2", str(folder / f"{variant}.safetensors"), seed=FLUX2_SEED,
                                     prefix=COMFY_PREFIX, variant="" if variant == "dev" else variant)
        detected = comfy_detection(meta_state(read_checkpoint_header(path)))
        # ComfyUI's detection hardcodes the released latent's 128 output channels; the tiny latent has 16
        config = {**detected, "out_channels": detected["in_channels"]}
        network = load_comfy_weights(comfy.ldm.flux.model.Flux(**config, **comfy_settings()), path)
        cases = flux2_comfy_cases(variant)

        def call(net, x, t, inputs):
            return net(x, t, inputs["context"], transformer_options={},
                       **{key: value for key, value in inputs.items() if key != "context"})
        out[variant] = path, detected, comfy_outputs(network, cases, call)
    return out


FLUX2_ROPE = dict(scale_x=1.5, shift_x=2.0, scale_y=0.5, shift_y=-1.0, scale_t=1.0, shift_t=0.5)  # ScaleROPE's


@pytest.fixture(scope="module")
def flux2_comfy_rope(flux2_comfy):
    """{variant: (file, ComfyUI's outputs with ScaleROPE's rope_options)}."""
    import comfy.ldm.flux.model
    out = {}
    for variant, (path, detected, _) in flux2_comfy.items():
        config = {**detected, "out_channels": detected["in_channels"]}
        network = load_comfy_weights(comfy.ldm.flux.model.Flux(**config, **comfy_settings()), path)

        def call(net, x, t, inputs):
            return net(x, t, inputs["context"], transformer_options={"rope_options": dict(FLUX2_ROPE)},
                       **{key: value for key, value in inputs.items() if key != "context"})
        out[variant] = path, comfy_outputs(network, flux2_comfy_cases(variant), call)
    return out


@needs("flux2")
def test_flux2_scale_rope_equals_comfys_flux(family_pool, flux2_comfy_rope, flux2_comfy):
    import comfy.ldm.flux.model
    if "rope_options" not in inspect.getsource(comfy.ldm.flux.model.Flux.process_img):
        pytest.skip("this ComfyUI's Flux has no ScaleROPE")
    for variant, (path, expected) in flux2_comfy_rope.items():
        cases = {name: (x, t, {**inputs, "rope_options": dict(FLUX2_ROPE)})
                 for name, (x, t, inputs) in flux2_comfy_cases(variant).items()}
        check_pool(family_pool, path, cases, expected, f"comfyui_flux2_rope_{variant}")
        plain = flux2_comfy[variant][2]
        assert any((expected[name] - plain[name]).abs().max() > 1e-3 for name in expected)  # the options matter


def flux2_comfy_cases(variant: str) -> dict:
    """test_flux2's cases: those with guidance for dev, the one without for klein."""
    cases = flux2_cases()
    return {name: case for name, case in cases.items() if ("guidance" in case[2]) == (variant == "dev")}


@needs("flux2")
def test_flux2_pool_equals_comfys_flux(family_pool, flux2_comfy):
    for variant, (path, _, expected) in flux2_comfy.items():
        check_pool(family_pool, path, flux2_comfy_cases(variant), expected, f"comfyui_flux2_{variant}")


@needs("flux2")
def test_flux2_comfy_detection_equals_ours(flux2_comfy):
    for variant, (path, detected, _) in flux2_comfy.items():
        config = flux2.detect(read_checkpoint_header(path)).config
        assert detected["image_model"] == "flux2"
        assert detected["num_heads"] == config["num_attention_heads"]
        assert detected["hidden_size"] == config["num_attention_heads"] * config["attention_head_dim"]
        assert (detected["depth"], detected["depth_single_blocks"]) == (config["num_layers"],
                                                                        config["num_single_layers"])
        assert detected["context_in_dim"] == config["joint_attention_dim"]
        assert list(detected["axes_dim"]) == list(config["axes_dims_rope"])
        assert detected["theta"] == config["rope_theta"] and detected["mlp_ratio"] == config["mlp_ratio"]
        assert detected["guidance_embed"] == config["guidance_embeds"] == (variant == "dev")
