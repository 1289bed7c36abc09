"""SD3 / SD3.5 under Ulysses SP, what is special to it (test_family_conformance.py checks its parity at every degree
and layout, its file layouts, a quantized file and a LoRA from sp_lab.conformance, on a tiny SD3.5 Medium: MMDiT-X
with a second attention in block 0, 3 heads of 64 that no degree above 1 divides, q/k RMS norms): SD3.5 Large's
layout; detection of every layout, against neighbouring families and at released sizes; the key plan (diffusers'
converter) against a hand-written writer; a LoRA on the fused qkv; refusals by name; ComfyUI's own MMDiT."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from family_support import FP32_TOL, assert_parity, at_worlds, relative_error
from sp_lab.conformance.cases import sd3_cases as make_cases
from sp_lab.references.sd3 import reference_forward
from sp_runtime.families import flux, sd3, z_image
from sp_runtime.detection import detect as detect_any
from sp_runtime.checkpoints.header import Header, read_checkpoint_header
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint as write_other
from sp_lab.tiny_models import sd3 as tiny

pytest_plugins = ["family_pools"]  # the shared per-degree worker pools
SEED = 4
LAYOUTS = {"comfy_prefix": dict(prefix=COMFY_PREFIX), "comfy": {}, "diffusers": dict(layout="diffusers"),
           "diffusers_folder": dict(layout="diffusers_folder"), "large_comfy": dict(variant="3.5_large")}


@pytest.fixture(scope="session")
def sd3_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sd3")
    return {name: write_other("sd3", str(folder / (name if "folder" in name else f"{name}.safetensors")),
                                     seed=SEED, **kw) for name, kw in LAYOUTS.items()}


@pytest.fixture(scope="session")
def sd3_references(family_subject):
    """SD3.5 Medium's outputs: the conformance suite's (same seed and cases); SD3.5 Large's one case: here."""
    references = {("3.5_medium", name): out for name, out in family_subject("sd3").outputs.items()}
    x, t, inputs = make_cases()["35_tokens"]
    references["3.5_large", "35_tokens"] = reference_forward(tiny.build_tiny_model(SEED, "3.5_large"), x, t, **inputs)
    return references


@at_worlds(2)
def test_sd35_large_layout(family_pool, sd3_files, sd3_references):
    """SD3.5 Large's layout (no second attention); the conformance suite runs SD3.5 Medium's files."""
    handle = family_pool.load_model(sd3_files["large_comfy"])
    assert (handle.info.family, handle.info.variant) == ("sd3", "3.5_large")
    x, t, inputs = make_cases()["35_tokens"]
    assert_parity(handle(x, t, **inputs), sd3_references["3.5_large", "35_tokens"], "float32", "sd3_large/35_tokens")
    handle.unload()


def test_positions_timestep_and_text_matter(sd3_references):
    """Guards against a test that cannot fail: a crop of the positional table one row off, another timestep,
    fewer text tokens and zero padding each change the output."""
    model = tiny.build_tiny_model(SEED)
    x, t, inputs = make_cases()["35_tokens"]
    want = sd3_references["3.5_medium", "35_tokens"]
    table = model.pos_embed.pos_embed
    table.copy_(table.roll(12, dims=1))
    assert relative_error(reference_forward(model, x, t, **inputs), want) > 100 * FP32_TOL
    model = tiny.build_tiny_model(SEED)
    assert relative_error(reference_forward(model, x, t.flip(0), **inputs), want) > 100 * FP32_TOL
    assert relative_error(reference_forward(model, x, t, inputs["context"][:, :6], inputs["y"]), want) > 100 * FP32_TOL
    x, t, inputs = make_cases()["odd_latent"]
    zero_padded = reference_forward(model, torch.nn.functional.pad(x, (0, 1, 0, 1)), t, **inputs)[..., :7, :11]
    assert relative_error(zero_padded, sd3_references["3.5_medium", "odd_latent"]) > 100 * FP32_TOL


def test_detection_of_every_layout_and_of_neighbours(sd3_files, tmp_path):
    expected = {"comfy_prefix": ("original", COMFY_PREFIX, "3.5_medium"), "comfy": ("original", "", "3.5_medium"),
                "diffusers": ("diffusers", "", "3.5_medium"), "diffusers_folder": ("diffusers", "", "3.5_medium"),
                "large_comfy": ("original", "", "3.5_large")}
    want = tiny.tiny_config()
    for layout, path in sd3_files.items():
        header = read_checkpoint_header(path)
        detection = detect_any(header)
        assert detection.family == "sd3"
        assert (detection.layout, detection.prefix, detection.variant) == expected[layout]
        config = {key: detection.config[key] for key in ("num_layers", "num_attention_heads", "attention_head_dim",
                                                         "pos_embed_max_size", "joint_attention_dim", "qk_norm")}
        assert config == {key: want[key] for key in config}
        assert tuple(detection.config["dual_attention_layers"]) == ((0,) if layout != "large_comfy" else ())
        assert flux.detect(header) is None and z_image.detect(header) is None
    neighbour = read_checkpoint_header(write_other("flux", str(tmp_path / "flux.safetensors"), seed=1))
    assert sd3.detect(neighbour) is None and detect_any(neighbour).family == "flux"


def released_header(width: int, blocks: int, side: int, dual: range) -> Header:
    """Header entries of a released SD3.5 file in ComfyUI's layout (fp8 scaled aside: shapes only)."""
    keys = {"x_embedder.proj.weight": (width, 16, 2, 2), "pos_embed": (1, side * side, width),
            "t_embedder.mlp.0.weight": (width, 256), "y_embedder.mlp.0.weight": (width, 2048),
            "context_embedder.weight": (width, 4096), "final_layer.linear.weight": (64, width)}
    for i in range(blocks):
        for side_name in ("x_block", "context_block"):
            keys[f"joint_blocks.{i}.{side_name}.attn.qkv.weight"] = (3 * width, width)
            keys[f"joint_blocks.{i}.{side_name}.attn.ln_q.weight"] = (64,)
        if i in dual:
            keys[f"joint_blocks.{i}.x_block.attn2.qkv.weight"] = (3 * width, width)
    return Header("sd3.5.safetensors", {COMFY_PREFIX + key: ("BF16", shape) for key, shape in keys.items()})


def test_released_sizes_read_as_comfyui_reads_them():
    large = sd3.detect(released_header(2432, 38, 192, range(0)))
    assert (large.variant, large.config["num_attention_heads"], large.config["num_layers"],
            large.config["pos_embed_max_size"], large.config["dual_attention_layers"]) == ("3.5_large", 38, 38, 192, ())
    medium = sd3.detect(released_header(1536, 24, 384, range(13)))
    assert (medium.variant, medium.config["num_attention_heads"], medium.config["pos_embed_max_size"],
            medium.config["dual_attention_layers"]) == ("3.5_medium", 24, 384, tuple(range(13)))


@pytest.mark.parametrize("variant", sorted(tiny.VARIANTS))
def test_key_plan_inverts_the_comfyui_writer(variant):
    """diffusers' converter, run per tensor through the plan, gives back every parameter of the model the
    hand-written ComfyUI writer started from (the last block's and the final layer's swapped halves included)."""
    model = tiny.build_tiny_model(SEED, variant)
    original = tiny.original_state_dict(model)
    plan = sd3.original_plan(original, model.config)
    assert plan.keys() == original.keys()
    got = {target: transform(original[source]) if transform else original[source]
           for source, targets in plan.items() for target, transform in targets}
    state = model.state_dict()
    assert got.keys() == state.keys() and all(torch.equal(got[key], state[key]) for key in state)


def test_lora_on_the_fused_qkv_splits_like_the_weight(sd3_files, tmp_path):
    from sp_runtime.lora.apply import LoraState
    path = sd3_files["comfy_prefix"]
    model = sd3.load_model(path, "float32")[0]
    before = {name: value.clone() for name, value in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    width, rank, alpha, strength = 192, 4, 2.0, 0.7
    up, down = torch.randn(3 * width, rank, generator=g), torch.randn(rank, width, generator=g)
    stem = "diffusion_model.joint_blocks.2.context_block.attn.qkv"
    lora = str(tmp_path / "qkv_lora.safetensors")
    save_file({f"{stem}.lora_B.weight": up, f"{stem}.lora_A.weight": down, f"{stem}.alpha": torch.tensor(alpha)},
              lora)
    state = LoraState(model, "sd3", path, torch.device("cpu"))
    assert state.set([[lora, strength]])["parameters"] == 3
    delta = strength * alpha / rank * (up @ down)
    after = model.state_dict()
    for index, part in enumerate("qkv"):
        key = f"transformer_blocks.2.attn.add_{part}_proj.weight"
        assert relative_error(after[key], before[key] + delta[index * width:(index + 1) * width]) <= 1e-6, key
    state.set([])
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())


def test_refusals_name_what_is_not_served(sd3_files):
    from sp_runtime.contract import LoadRequest
    from sp_runtime.groups import SeqParallel
    from family_support import LocalContext
    groups = type("Groups", (), {"seq": SeqParallel.single()})()
    path = sd3_files["comfy"]
    worker = sd3.load(LoadRequest(path, "float32"), sd3.detect(read_checkpoint_header(path)), torch.device("cpu"),
                      groups, lambda *_: None)
    x, t, inputs = make_cases()["2_tokens"]
    out = torch.empty_like(x)
    for change, message in ((dict(control={"input": []}), "ControlNet"), (dict(y=None), "pooled CLIP"),
                            (dict(context=inputs["context"][..., :8]), "context")):
        with pytest.raises(ValueError, match=message):
            worker.forward(x, t, {**inputs, **change}, out, LocalContext(groups))
    big = torch.zeros(1, 16, 26, 8)
    with pytest.raises(ValueError, match="at most 12 per side"):
        worker.forward(big, t, inputs, torch.empty_like(big), LocalContext(groups))


# ---------------------------------------------------------------------------------------------------------------
# ComfyUI tier (needs COMFYUI_PATH): ComfyUI's own MMDiT, built from its own detection of the tiny file

def comfy_network(path: str):
    import comfy.model_detection
    import comfy.ops
    import comfy.utils
    from comfy.ldm.modules.diffusionmodules.mmdit import OpenAISignatureMMDITWrapper
    state = comfy.utils.load_torch_file(path)
    config = comfy.model_detection.detect_unet_config(state, COMFY_PREFIX)
    network = OpenAISignatureMMDITWrapper(**config, operations=comfy.ops.disable_weight_init, dtype=torch.float32,
                                          device="cpu")
    missing, unexpected = network.load_state_dict(
        comfy.utils.state_dict_prefix_replace(state, {COMFY_PREFIX: ""}, filter_keys=True), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return config, network.eval()


@pytest.fixture(scope="session")
def sd3_comfy(sd3_files):
    import comfy_support as cs
    cs.import_comfy()
    config, network = comfy_network(sd3_files["comfy_prefix"])
    with torch.no_grad():
        outputs = {name: network(x, t, context=inputs["context"], y=inputs["y"], transformer_options={})
                   for name, (x, t, inputs) in make_cases().items()}
    return config, outputs


def _needs_comfyui():
    import comfy_support as cs
    return pytest.mark.skipif(cs.comfyui_path() is None, reason=cs.NO_COMFYUI)


@_needs_comfyui()
def test_pool_equals_comfys_mmdit(family_pool, sd3_files, sd3_comfy):
    """ComfyUI's MMDiT (x_block_self_attn_layers [0]: SD3.5 Medium's MMDiT-X) holding the same file's weights."""
    handle = family_pool.load_model(sd3_files["comfy_prefix"])
    for name, (x, t, inputs) in make_cases().items():
        assert_parity(handle(x, t, **inputs), sd3_comfy[1][name], "float32", f"comfyui_sd3/{name}")
    handle.unload()


@_needs_comfyui()
def test_comfy_detection_equals_ours(sd3_files, sd3_comfy):
    theirs, ours = sd3_comfy[0], sd3.detect(read_checkpoint_header(sd3_files["comfy_prefix"])).config
    assert theirs["depth"] == ours["num_layers"] == ours["num_attention_heads"]
    assert theirs["pos_embed_max_size"] == ours["pos_embed_max_size"]
    assert tuple(theirs["x_block_self_attn_layers"]) == ours["dual_attention_layers"]
    assert (theirs.get("qk_norm") == "rms") == (ours["qk_norm"] == "rms_norm")
    assert (theirs["adm_in_channels"], theirs["in_channels"]) == (ours["pooled_projection_dim"], ours["in_channels"])


def test_all_in_one_fp8_scaled_checkpoint_as_the_template_loads_it(tmp_path):
    """sd3.5_large_fp8_scaled.safetensors as the templates load it ("Load Checkpoint"): ComfyUI's legacy scaled fp8
    under model.diffusion_model. beside text encoders and a VAE; it loads as the float weights it encodes."""
    from sp_lab.tiny_models.quant_files import _write_comfy
    from sp_lab.tiny_models.weights import pack_all_in_one
    state = tiny.original_state_dict(tiny.build_tiny_model(SEED, "3.5_large"))
    reference_path, fp8_path = str(tmp_path / "reference.safetensors"), str(tmp_path / "fp8.safetensors")
    reference, kinds = _write_comfy({k: v.contiguous() for k, v in state.items()}, fp8_path, "scaled_fp8",
                                    COMFY_PREFIX, {}, None)
    assert kinds and all(key.startswith("joint_blocks.") for key in kinds)
    save_file(reference, reference_path)
    parts = {"text_encoders.clip_g.transformer.text_model.final_layer_norm.weight": torch.ones(8),
             "first_stage_model.decoder.conv_in.weight": torch.zeros(8, 16, 3, 3)}
    path = pack_all_in_one(fp8_path, str(tmp_path / "sd3.5_large_fp8_scaled.safetensors"), parts)
    detection = detect_any(read_checkpoint_header(path))
    assert (detection.family, detection.variant, detection.prefix) == ("sd3", "3.5_large", COMFY_PREFIX)
    assert "scaled" in detection.quant or "fp8" in detection.quant, detection.quant
    got = sd3.load_model(path, "float32")[0].state_dict()
    want = sd3.load_model(reference_path, "float32")[0].state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[key], want[key]) for key in want)


@_needs_comfyui()
def test_comfy_model_class_from_header(sd3_files):
    """The host side builds ComfyUI's SD3 model config (its latent format and sampling) for these files, from
    ComfyUI's detection of the header and from ours alone."""
    import comfy_support as cs
    cs.import_comfy()
    import comfy.latent_formats
    import comfy.supported_models
    from sp_runtime.contract import ModelInfo
    comfy_model = cs.import_node_module("comfy_model")
    for layout in ("comfy_prefix", "diffusers"):
        header = read_checkpoint_header(sd3_files[layout])
        info = ModelInfo(family="sd3", variant=sd3.detect(header).variant, in_channels=16, out_channels=16, x_ndim=4)
        for config in (comfy_model.comfy_model_config(header, info), comfy_model.config_from_info(info)):
            assert type(config) is comfy.supported_models.SD3, layout
            assert type(config.latent_format) is comfy.latent_formats.SD3
