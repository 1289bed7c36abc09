"""HiDream I1 / E1 beyond the conformance suite (tests/families/test_family_conformance.py runs every degree, layout
and file layout on sp_lab.conformance.cases.hidream_cases against diffusers' stock HiDreamImageTransformer2DModel: 20
heads, which degree 3 does not divide; 35 image tokens, an odd latent with E1's image_cond joined on the right, 2
tokens, batch 2): what the cases exercise, detection against neighbours and HiDream-O1, refusals by name, the
templates' fp8 / bf16 files; ComfyUI's own HiDream where present."""
from __future__ import annotations

import pytest
import torch

from family_support import FP32_TOL, assert_parity, relative_error
from sp_lab.conformance.cases import hidream_cases as make_cases
from sp_lab.references.hidream import reference_forward
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint as write_other
from sp_lab.tiny_models import hidream as tiny
from sp_runtime.checkpoints.header import Header, read_checkpoint_header
from sp_runtime.detection import detect as detect_any
from sp_runtime.families import chroma, flux, hidream, sd3

pytest_plugins = ["family_pools"]  # the shared per-degree worker pools
SEED = 8  # the conformance suite's tiny HiDream (sp_lab.conformance.product)
LAYOUTS = {"comfy_prefix": dict(prefix=COMFY_PREFIX), "comfy": {}, "diffusers_folder": dict(layout="diffusers_folder")}


@pytest.fixture(scope="session")
def hidream_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hidream")
    return {name: write_other("hidream", str(folder / (name if "folder" in name else f"{name}.safetensors")),
                                         seed=SEED, **kw) for name, kw in LAYOUTS.items()}


def test_reference_image_llama_layers_and_timestep_matter(family_subject):
    """Guards against a test that cannot fail: without E1's image_cond, with another block's Llama layer, with
    another timestep, or zero padded, the output differs."""
    model = tiny.build_tiny_model(SEED)
    x, t, inputs = make_cases()["odd_edit"]
    want = family_subject("hidream").outputs["odd_edit"]
    llama = inputs["encoder_hidden_states_llama3"]
    others = [{**inputs, "image_cond": None}, {**inputs, "encoder_hidden_states_llama3": llama[:, [0, 1, 3, 2]]},
              {**inputs, "encoder_hidden_states_llama3": llama[:, [1, 0, 2, 3]]}]
    for changed in others:
        assert relative_error(reference_forward(model, x, t, **changed), want) > 100 * FP32_TOL
    assert relative_error(reference_forward(model, x, t.flip(0), **inputs), want) > 100 * FP32_TOL
    padded = {**inputs, "image_cond": torch.nn.functional.pad(inputs["image_cond"], (0, 1, 0, 1))}
    padded = reference_forward(model, torch.nn.functional.pad(x, (0, 1, 0, 1)), t, **padded)[..., :7, :11]
    assert relative_error(padded, want) > 100 * FP32_TOL


def test_detection_of_every_layout_and_of_neighbours(hidream_files, tmp_path):
    expected = {"comfy_prefix": COMFY_PREFIX, "comfy": "", "diffusers_folder": ""}
    want = tiny.tiny_config()
    for layout, path in hidream_files.items():
        header = read_checkpoint_header(path)
        detection = detect_any(header)
        assert detection.family == "hidream" and detection.prefix == expected[layout]
        for key, value in want.items():
            assert list(detection.config[key]) == list(value) if isinstance(value, (list, tuple)) else \
                detection.config[key] == value, key
        assert flux.detect(header) is None and sd3.detect(header) is None and chroma.detect(header) is None
    neighbour = read_checkpoint_header(write_other("flux", str(tmp_path / "flux.safetensors"), seed=1))
    assert hidream.detect(neighbour) is None and detect_any(neighbour).family == "flux"
    o1 = Header("hidream_o1.safetensors", {"t_embedder1.mlp.0.weight": ("F32", (8, 4)),
                                           "x_embedder.proj1.weight": ("F32", (8, 4))})
    with pytest.raises(ValueError, match="HiDream-O1"):
        detect_any(o1)


def test_refusals_name_the_input(family_pool, hidream_files):
    if family_pool.config.world_size != 2:
        pytest.skip("checked at degree 2")
    handle = family_pool.load_model(hidream_files["comfy_prefix"])
    x, t, inputs = make_cases()["35_tokens"]
    bad = {"encoder_hidden_states_llama3": {**inputs, "encoder_hidden_states_llama3": None},
           "Llama layers": {**inputs, "encoder_hidden_states_llama3": inputs["encoder_hidden_states_llama3"][:, :3]},
           "image_cond": {**inputs, "image_cond": torch.zeros(2, 16, 9, 14)},
           "ControlNet": {**inputs, "control": {"output": []}}}
    for needle, changed in bad.items():
        with pytest.raises(Exception, match=needle):
            handle(x, t, **changed)
    assert_parity(handle(x, t, **inputs), reference_forward(tiny.build_tiny_model(SEED), x, t, **inputs), "float32",
                  "hidream_after_refusals/35_tokens")
    handle.unload()



def test_template_formats_fp8_and_bf16(family_pool, tmp_path):
    """hidream_i1_{full,dev,fast}_fp8 (fp8 matrices, bf16 vectors) and hidream_e1_*_bf16 as the templates load them
    (UNETLoader): each loads as the weights it stores, and the pool at degree 2 computing in float32 equals the
    reference forward of those weights. (Low-precision compute is not compared: on this tiny random model bf16
    alone moves diffusers' own output 3-13% from float32, the experts' routing flipping.)"""
    if family_pool.config.world_size != 2:
        pytest.skip("checked at degree 2")
    want = tiny.build_tiny_model(SEED).state_dict()
    for dtype, name in (("float8_e4m3fn", "hidream_i1_full_fp8"), ("bfloat16", "hidream_e1_1_bf16")):
        path = write_other("hidream", str(tmp_path / f"{name}.safetensors"), dtype=dtype, seed=SEED,
                                      prefix=COMFY_PREFIX)
        assert detect_any(read_checkpoint_header(path)).family == "hidream"
        got = hidream.load_model(path)[0].state_dict()  # the loader's storage dtype takes the vectors too
        assert got.keys() == want.keys()
        assert all(torch.equal(got[key].float(), want[key].to(getattr(torch, dtype)).float())
                   for key in want if want[key].dim() >= 2)
        model = hidream.load_model(path, "float32")[0]
        handle = family_pool.load_model(path, "float32")
        for case in ("35_tokens", "odd_edit"):
            x, t, inputs = make_cases()[case]
            assert_parity(handle(x, t, **inputs), reference_forward(model, x, t, **inputs), "float32",
                          f"hidream_{name}/{case}")
        handle.unload()

# ---------------------------------------------------------------------------------------------------------------
# ComfyUI tier (needs COMFYUI_PATH): ComfyUI's own HiDream network, built from ComfyUI's detection of the tiny file
# (its constants at the released size) with the tiny sizes the header cannot show.
def _needs_comfyui():
    import comfy_support as cs
    return pytest.mark.skipif(cs.comfyui_path() is None, reason=cs.NO_COMFYUI)


@pytest.fixture(scope="session")
def hidream_comfy(hidream_files):
    import comfy_support as cs
    cs.import_comfy()
    import comfy.model_detection
    import comfy.ops
    import comfy.utils
    from comfy.ldm.hidream.model import HiDreamImageTransformer2DModel
    path = hidream_files["comfy_prefix"]
    state = comfy.utils.load_torch_file(path)
    config = comfy.model_detection.detect_unet_config(state, COMFY_PREFIX)
    sizes = {key: value for key, value in tiny.tiny_config().items() if key in config}
    network = HiDreamImageTransformer2DModel(**{**config, **sizes}, operations=comfy.ops.disable_weight_init,
                                             dtype=torch.float32, device="cpu")
    state = comfy.utils.state_dict_prefix_replace(state, {COMFY_PREFIX: ""}, filter_keys=True)
    missing, unexpected = network.eval().load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    with torch.no_grad():
        outputs = {name: network(x, t, inputs["y"], inputs["context"], inputs["encoder_hidden_states_llama3"],
                                 inputs.get("image_cond"), transformer_options={})
                   for name, (x, t, inputs) in make_cases().items()}
    return path, config, outputs


@_needs_comfyui()
def test_pool_equals_comfys_hidream(family_pool, hidream_comfy):
    """At degrees 1 and 3."""
    if family_pool.config.world_size not in (1, 3):
        pytest.skip("ComfyUI's HiDream is checked at degrees 1 and 3")
    path, _, expected = hidream_comfy
    handle = family_pool.load_model(path)
    for name, (x, t, inputs) in make_cases().items():
        assert_parity(handle(x, t, **inputs), expected[name], "float32", f"comfyui_hidream/{name}")
    handle.unload()


@_needs_comfyui()
def test_comfy_detection_equals_ours(hidream_comfy):
    """ComfyUI's constants (released size) and ours from the tiny header: the same rules, scaled to the head size."""
    path, theirs, _ = hidream_comfy
    ours = hidream.detect(read_checkpoint_header(path)).config
    assert theirs["image_model"] == "hidream"
    for key in ("num_attention_heads", "num_routed_experts", "num_activated_experts", "in_channels", "out_channels",
                "patch_size"):
        assert theirs[key] == ours[key], key
    blocks = ours["num_layers"] + ours["num_single_layers"]
    assert ours["llama_layers"] == theirs["llama_layers"][:blocks]
    scale = theirs["attention_head_dim"] // ours["attention_head_dim"]
    assert [scale * dims for dims in ours["axes_dims_rope"]] == list(theirs["axes_dims_rope"])


@_needs_comfyui()
def test_comfy_model_class_from_header(hidream_files):
    """The host side builds ComfyUI's HiDream model config (Flux's latent format) for these files, from ComfyUI's
    detection of the header and from ours alone."""
    import comfy_support as cs
    cs.import_comfy()
    import comfy.latent_formats
    import comfy.supported_models
    from sp_runtime.contract import ModelInfo
    comfy_model = cs.import_node_module("comfy_model")
    for layout in ("comfy_prefix", "diffusers_folder"):
        header = read_checkpoint_header(hidream_files[layout])
        info = ModelInfo(family="hidream", variant="", in_channels=16, out_channels=16, x_ndim=4)
        for config in (comfy_model.comfy_model_config(header, info), comfy_model.config_from_info(info)):
            assert type(config) is comfy.supported_models.HiDream, layout
            assert type(config.latent_format) is comfy.latent_formats.Flux
