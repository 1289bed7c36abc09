"""Chroma under Ulysses SP, what is special to it (test_family_conformance.py checks its parity at every degree and
layout, its file layouts, a quantized file and a LoRA from sp_lab.conformance: a tiny Chroma, 6 heads, 2 double +
2 single blocks, 35 and 24 image tokens, 2 tokens, batch 2, a text padding mask and a guidance other than 0): detection
against Flux.1 and of Chroma Radiance (its head's facts and markers from the header; an incomplete one refused by
name); the key plan against a hand-written writer and against
diffusers' converter at full size; a LoRA on the fused single-block linear1."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from family_support import FP32_TOL, assert_parity, at_worlds, relative_error
from sp_lab.conformance.cases import chroma_cases as make_cases
from sp_lab.references.chroma import reference_forward
from sp_runtime.families import chroma, flux, sd3
from sp_runtime.detection import detect as detect_any
from sp_runtime.checkpoints.header import Header, read_checkpoint_header
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint as write_other
from sp_lab.tiny_models import chroma as tiny

pytest_plugins = ["family_pools"]  # the shared per-degree worker pools
SEED = 6
LAYOUTS = {"comfy_prefix": dict(prefix=COMFY_PREFIX), "comfy": {}, "diffusers": dict(layout="diffusers"),
           "diffusers_folder": dict(layout="diffusers_folder")}


@pytest.fixture(scope="session")
def chroma_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chroma")
    return {name: write_other("chroma", str(folder / (name if "folder" in name else f"{name}.safetensors")),
                                        seed=SEED, **kw) for name, kw in LAYOUTS.items()}


@pytest.fixture(scope="session")
def chroma_references(family_subject):
    """The conformance suite's outputs (same seed and cases)."""
    return family_subject("chroma").outputs


def test_mask_guidance_and_timestep_matter(chroma_references):
    """Guards against a test that cannot fail: without the mask, with guidance 0, with another timestep, or zero
    padded, the output differs."""
    model = tiny.build_tiny_model(SEED)
    x, t, inputs = make_cases()["odd_masked_guided"]
    want = chroma_references["odd_masked_guided"]
    others = [{**inputs, "attention_mask": None}, {**inputs, "guidance": None}]
    for changed in others:
        assert relative_error(reference_forward(model, x, t, **changed), want) > 100 * FP32_TOL
    assert relative_error(reference_forward(model, x, t.flip(0), **inputs), want) > 100 * FP32_TOL
    padded = reference_forward(model, torch.nn.functional.pad(x, (0, 1, 0, 1)), t, **inputs)[..., :7, :11]
    assert relative_error(padded, want) > 100 * FP32_TOL


def test_detection_of_every_layout_and_of_neighbours(chroma_files, tmp_path):
    expected = {"comfy_prefix": ("original", COMFY_PREFIX), "comfy": ("original", ""), "diffusers": ("diffusers", ""),
                "diffusers_folder": ("diffusers", "")}
    want = tiny.tiny_config()
    for layout, path in chroma_files.items():
        header = read_checkpoint_header(path)
        detection = detect_any(header)
        assert detection.family == "chroma"
        assert (detection.layout, detection.prefix) == expected[layout]
        for key in ("num_layers", "num_single_layers", "num_attention_heads", "approximator_hidden_dim",
                    "approximator_layers", "joint_attention_dim"):
            assert detection.config[key] == want[key], key
        assert flux.detect(header) is None and sd3.detect(header) is None
    neighbour = read_checkpoint_header(write_other("flux", str(tmp_path / "flux.safetensors"), seed=1))
    assert chroma.detect(neighbour) is None and detect_any(neighbour).family == "flux"
    radiance = {**read_checkpoint_header(chroma_files["comfy"]).tensors, "nerf_blocks.0.norm.scale": ("F32", (32,))}
    with pytest.raises(ValueError, match="incomplete or unknown Chroma Radiance"):
        detect_any(Header("chroma_radiance.safetensors", radiance))


@pytest.mark.parametrize("markers", [(), ("__x0__",), ("__x0__", "__sequential__")])
def test_radiance_detection_reads_its_head_and_markers(tmp_path, markers):
    """ComfyUI's Radiance file: the variant, the trunk's config on C*P*P pixel features, the NeRF head's facts from
    its shapes, the x0 / sequential text ids markers; the conv and linear final heads; a Flux / Chroma detector
    leaves it alone."""
    path = write_other("chroma", str(tmp_path / "radiance.safetensors"), seed=SEED, prefix=COMFY_PREFIX,
                       variant="radiance", x0="__x0__" in markers, sequential_text_ids="__sequential__" in markers,
                       nerf_head="linear" if not markers else "conv", nerf_mlp_ratio=3)
    header = read_checkpoint_header(path)
    detection = detect_any(header)
    assert (detection.family, detection.variant, detection.layout, detection.prefix) == (
        "chroma", "radiance", "original", COMFY_PREFIX)
    want = {**tiny.tiny_config(in_channels=48), "out_channels": 48, "pixel_patch": 4, "nerf_hidden_size": 8,
            "nerf_mlp_ratio": 3, "nerf_depth": 2, "nerf_max_freqs": 3, "nerf_head": "linear" if not markers else "conv",
            "x0": "__x0__" in markers, "sequential_text_ids": "__sequential__" in markers}
    assert {key: detection.config[key] for key in want} == want
    assert flux.detect(header) is None
    model = chroma.load_model(path, "float32")[0]
    assert not hasattr(model, "proj_out") and model.radiance.nerf_head == want["nerf_head"]


def test_radiance_markers_and_refusals_matter():
    """Guards for the Radiance spec of the conformance suite (x0 and sequential text ids on): each marker changes
    the output, and what its plan does not serve is refused by name."""
    from dataclasses import replace
    from types import SimpleNamespace
    from sp_lab.conformance.cases import chroma_radiance_cases
    from sp_runtime.families.chroma import radiance_plan
    model = tiny.build_tiny_model(SEED, variant="radiance")
    x, t, inputs = chroma_radiance_cases()["35_patches"]
    want = reference_forward(model, x, t, **inputs)
    for fact in ("x0", "sequential_text_ids"):
        model.radiance = replace(tiny.build_tiny_model(SEED, variant="radiance").radiance, **{fact: False})
        assert relative_error(reference_forward(model, x, t, **inputs), want) > 100 * FP32_TOL, fact
    for name, value in (("ref_latents", [x]), ("control", {"input": [x]})):
        call = SimpleNamespace(inputs={**inputs, name: value}, x=x, config=model.config, model=model)
        with pytest.raises(ValueError, match=f"{name} is not supported by Chroma Radiance"):
            radiance_plan.check(call)
    with pytest.raises(ValueError, match="Chroma Radiance takes pixels"):
        radiance_plan.check(SimpleNamespace(inputs=inputs, x=x[:, :2], config=model.config, model=model))


@at_worlds(3)
def test_radiance_with_sharded_weights_equals_the_reference(family_pool, family_subject):
    """shard_weights gathers each NeRF block in its one call per forward, on every rank: also on a rank with no
    patches (2 patches over 3 ranks) and with uneven ones (35 over 3)."""
    subject = family_subject("chroma:radiance")
    subject.check(family_pool, subject.path, "shard_weights", cases=("35_patches", "2_patches"), shard_weights=True)


def test_key_plan_inverts_the_comfyui_writer_and_matches_diffusers_at_full_size():
    from accelerate import init_empty_weights
    from diffusers import ChromaTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_chroma_transformer_checkpoint_to_diffusers
    model = tiny.build_tiny_model(SEED)
    original = tiny.original_state_dict(model)
    plan = chroma.original_plan(original, model.config)
    got = {target: transform(original[source]) if transform else original[source]
           for source, targets in plan.items() for target, transform in targets}
    state = model.state_dict()
    assert got.keys() == state.keys() and all(torch.equal(got[key], state[key]) for key in state)
    with init_empty_weights():  # the released size (the converter hardcodes width 3072): names and shapes
        full = ChromaTransformer2DModel()
    original = tiny.original_state_dict(full)
    want = convert_chroma_transformer_checkpoint_to_diffusers(dict(original))
    plan = chroma.original_plan(original, full.config)
    got = {target: transform(original[source]) if transform else original[source]
           for source, targets in plan.items() for target, transform in targets}
    assert got.keys() == want.keys() == full.state_dict().keys()
    assert all(got[key].shape == want[key].shape for key in want)


def test_lora_on_the_fused_linear1_splits_like_the_weight(chroma_files, tmp_path):
    from sp_runtime.lora.apply import LoraState
    path = chroma_files["comfy_prefix"]
    model = chroma.load_model(path, "float32")[0]
    before = {name: value.clone() for name, value in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    width, rank, alpha, strength = 96, 4, 2.0, 0.7
    up, down = torch.randn(7 * width, rank, generator=g), torch.randn(rank, width, generator=g)
    stem = "diffusion_model.single_blocks.1.linear1"
    lora = str(tmp_path / "linear1_lora.safetensors")
    save_file({f"{stem}.lora_B.weight": up, f"{stem}.lora_A.weight": down, f"{stem}.alpha": torch.tensor(alpha)},
              lora)
    state = LoraState(model, "chroma", path, torch.device("cpu"))
    assert state.set([[lora, strength]])["parameters"] == 4
    delta = strength * alpha / rank * (up @ down)
    after = model.state_dict()
    rows = {"attn.to_q": (0, width), "attn.to_k": (width, width), "attn.to_v": (2 * width, width),
            "proj_mlp": (3 * width, 4 * width)}
    for name, (start, count) in rows.items():
        key = f"single_transformer_blocks.1.{name}.weight"
        assert relative_error(after[key], before[key] + delta[start:start + count]) <= 1e-6, key
    state.set([])
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())


# ---------------------------------------------------------------------------------------------------------------
# ComfyUI tier (needs COMFYUI_PATH): ComfyUI's own Chroma. Its forward hardcodes the released model's 344
# modulation vectors (the final layer takes the last two), so this model has the released block counts (19 double,
# 38 single) at the tiny width; ComfyUI's detection gives the rest at the released width, set to the tiny one.
COMFY_SIZE = dict(num_layers=19, num_single_layers=38)


def _needs_comfyui():
    import comfy_support as cs
    return pytest.mark.skipif(cs.comfyui_path() is None, reason=cs.NO_COMFYUI)


@pytest.fixture(scope="session")
def chroma_comfy(tmp_path_factory):
    import comfy_support as cs
    cs.import_comfy()
    import comfy.model_detection
    import comfy.ops
    import comfy.utils
    from comfy.ldm.chroma.model import Chroma
    path = write_other("chroma", str(tmp_path_factory.mktemp("chroma_comfy") / "c.safetensors"), seed=SEED,
                                 prefix=COMFY_PREFIX, **COMFY_SIZE)
    state = comfy.utils.load_torch_file(path)
    config = comfy.model_detection.detect_unet_config(state, COMFY_PREFIX)
    ours = tiny.tiny_config(**COMFY_SIZE)
    width = ours["num_attention_heads"] * ours["attention_head_dim"]
    sizes = dict(context_in_dim=ours["joint_attention_dim"], hidden_size=width, num_heads=ours["num_attention_heads"],
                 axes_dim=list(ours["axes_dims_rope"]), out_dim=width, hidden_dim=ours["approximator_hidden_dim"],
                 n_layers=ours["approximator_layers"])
    network = Chroma(**{**config, **sizes}, operations=comfy.ops.disable_weight_init, dtype=torch.float32,
                     device="cpu")
    state = comfy.utils.state_dict_prefix_replace(state, {COMFY_PREFIX: ""}, filter_keys=True)
    wanted = network.state_dict().keys()  # newer ComfyUI names the q / k norms' weight `.weight`
    state = {key if key in wanted else key.replace("_norm.scale", "_norm.weight"): value
             for key, value in state.items()}
    missing, unexpected = network.eval().load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    cases = {name: case for name, case in make_cases().items() if name != "odd_masked_guided"}
    x, t, inputs = make_cases()["odd_masked_guided"]
    cases["odd_guided"] = (x, t, {key: inputs[key] for key in ("context", "guidance")})
    with torch.no_grad():
        outputs = {name: network(x, t, inputs["context"], inputs.get("guidance", torch.zeros(x.shape[0])),
                                 transformer_options={}) for name, (x, t, inputs) in cases.items()}
    return path, config, cases, outputs


@_needs_comfyui()
def test_pool_equals_comfys_chroma(family_pool, chroma_comfy):
    """At degrees 2 and 3 (the 57-block model costs more than the others)."""
    if family_pool.config.world_size not in (2, 3):
        pytest.skip("ComfyUI's Chroma is checked at degrees 2 and 3")
    path, _, cases, expected = chroma_comfy
    handle = family_pool.load_model(path)
    for name, (x, t, inputs) in cases.items():
        assert_parity(handle(x, t, **inputs), expected[name], "float32", f"comfyui_chroma/{name}")
    handle.unload()


@_needs_comfyui()
def test_comfy_detection_equals_ours(chroma_comfy):
    path, theirs, _, _ = chroma_comfy
    ours = chroma.detect(read_checkpoint_header(path)).config
    assert theirs["image_model"] == "chroma"
    assert (theirs["depth"], theirs["depth_single_blocks"]) == (ours["num_layers"], ours["num_single_layers"])
    assert theirs["in_dim"] == ours["approximator_num_channels"]
    assert theirs["in_channels"] == ours["in_channels"]  # ComfyUI's 64: the 2x2 patches of 16 channels


def test_mixed_precision_file_as_the_template_loads_it(tmp_path):
    """Chroma1-HD-fp8mixed.safetensors as the template loads it (UNETLoader): ComfyUI's mixed precision
    (per-layer `.comfy_quant`); it loads as the float weights it encodes."""
    from sp_lab.tiny_models.quant_files import _write_comfy
    state = tiny.original_state_dict(tiny.build_tiny_model(SEED))
    reference_path, path = str(tmp_path / "reference.safetensors"), str(tmp_path / "Chroma1-HD-fp8mixed.safetensors")
    reference, kinds = _write_comfy({k: v.contiguous() for k, v in state.items()}, path, "comfy_quant", "", {}, None)
    assert len(set(kinds.values())) > 1
    save_file(reference, reference_path)
    detection = detect_any(read_checkpoint_header(path))
    assert detection.family == "chroma" and detection.quant
    got = chroma.load_model(path, "float32")[0].state_dict()
    want = chroma.load_model(reference_path, "float32")[0].state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[key], want[key]) for key in want)


@_needs_comfyui()
def test_comfy_model_class_from_header(chroma_files):
    """The host side builds ComfyUI's Chroma model config (its latent format and sampling) for these files, from
    ComfyUI's detection of the header and from ours alone."""
    import comfy_support as cs
    cs.import_comfy()
    import comfy.latent_formats
    import comfy.supported_models
    from sp_runtime.contract import ModelInfo
    comfy_model = cs.import_node_module("comfy_model")
    for layout in ("comfy_prefix", "diffusers"):
        header = read_checkpoint_header(chroma_files[layout])
        info = ModelInfo(family="chroma", variant=chroma.detect(header).variant, in_channels=16, out_channels=16,
                         x_ndim=4)
        for config in (comfy_model.comfy_model_config(header, info), comfy_model.config_from_info(info)):
            assert type(config) is comfy.supported_models.Chroma, layout
            assert type(config.latent_format) is comfy.latent_formats.Flux


# ComfyUI tier: ComfyUI's own ChromaRadiance (19 double / 38 single blocks for its hardcoded 344 modulations, the tiny
# width) on the Radiance file (x0 and sequential text ids); image sizes whole patches (ComfyUI's x0 residual subtracts
# the padded image from the cropped output, so it fails on padded sizes, which the pool serves).
@pytest.fixture(scope="session")
def radiance_comfy(tmp_path_factory):
    import comfy_support as cs
    cs.import_comfy()
    import comfy.model_detection
    import comfy.ops
    import comfy.utils
    from comfy.ldm.chroma_radiance.model import ChromaRadiance
    from sp_lab.conformance.cases import chroma_radiance_cases
    path = write_other("chroma", str(tmp_path_factory.mktemp("radiance_comfy") / "r.safetensors"), seed=SEED,
                       prefix=COMFY_PREFIX, variant="radiance", **COMFY_SIZE)
    state = comfy.utils.load_torch_file(path)
    config = comfy.model_detection.detect_unet_config(state, COMFY_PREFIX)
    ours = chroma.detect(read_checkpoint_header(path)).config
    width = ours["num_attention_heads"] * ours["attention_head_dim"]
    sizes = dict(context_in_dim=ours["joint_attention_dim"], hidden_size=width, num_heads=ours["num_attention_heads"],
                 axes_dim=list(ours["axes_dims_rope"]), out_dim=width, hidden_dim=ours["approximator_hidden_dim"],
                 n_layers=ours["approximator_layers"], nerf_hidden_size=ours["nerf_hidden_size"],
                 nerf_mlp_ratio=ours["nerf_mlp_ratio"], nerf_depth=ours["nerf_depth"],
                 nerf_max_freqs=ours["nerf_max_freqs"])
    network = ChromaRadiance(**{**config, **sizes}, operations=comfy.ops.disable_weight_init, dtype=torch.float32,
                             device="cpu")
    state = comfy.utils.state_dict_prefix_replace(state, {COMFY_PREFIX: ""}, filter_keys=True)
    wanted = network.state_dict().keys()  # newer ComfyUI names the norms' weight `.weight`
    state = {key if key in wanted else key[:-len("scale")] + "weight": value for key, value in state.items()}
    missing, unexpected = network.eval().load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    x, t, inputs = chroma_radiance_cases()["30_masked_guided"]
    cases = {"30_guided": (x, t, {key: inputs[key] for key in ("context", "guidance")}),
             "2_patches": chroma_radiance_cases()["2_patches"]}
    with torch.no_grad():
        outputs = {name: network(x, t, inputs["context"], inputs.get("guidance", torch.zeros(x.shape[0])),
                                 transformer_options={}) for name, (x, t, inputs) in cases.items()}
    return path, config, cases, outputs


@_needs_comfyui()
def test_pool_equals_comfys_chroma_radiance(family_pool, radiance_comfy):
    """At degrees 2 and 3: the final convolution crosses the ranks' patch borders."""
    if family_pool.config.world_size not in (2, 3):
        pytest.skip("ComfyUI's Chroma Radiance is checked at degrees 2 and 3")
    path, config, cases, expected = radiance_comfy
    assert config["image_model"] == "chroma_radiance" and config["use_x0"] and config["use_sequential_txt_ids"]
    handle = family_pool.load_model(path)
    for name, (x, t, inputs) in cases.items():
        assert_parity(handle(x, t, **inputs), expected[name], "float32", f"comfyui_chroma_radiance/{name}")
    handle.unload()


@_needs_comfyui()
def test_comfy_model_class_of_radiance(radiance_comfy):
    """The host builds ComfyUI's ChromaRadiance config (3-channel pixel latents) from ComfyUI's detection of the
    header and from ours alone."""
    import comfy_support as cs
    import comfy.latent_formats
    import comfy.supported_models
    from sp_runtime.contract import ModelInfo
    comfy_model = cs.import_node_module("comfy_model")
    path = radiance_comfy[0]
    header = read_checkpoint_header(path)
    detection = chroma.detect(header)
    info = ModelInfo(family="chroma", variant=detection.variant, in_channels=3, out_channels=3, x_ndim=4,
                     config={"pixel_patch": detection.config["pixel_patch"]})
    for config in (comfy_model.comfy_model_config(header, info), comfy_model.config_from_info(info)):
        assert type(config) is comfy.supported_models.ChromaRadiance
        assert type(config.latent_format) is comfy.latent_formats.ChromaRadiance
