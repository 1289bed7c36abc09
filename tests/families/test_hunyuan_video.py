"""HunyuanVideo 1.0 and 1.5 beyond the conformance suite (tests/families/test_family_conformance.py runs 1.0 T2V and
1.5 at every degree and layout, in every file layout, on sp_lab.conformance.cases.hunyuan_video_cases: head size 128
with 3 heads, token counts 35, 105 and 3, batch 2, a reference latent, 1.5's SigLIP + ByT5 tokens): 1.0 I2V (33
channels) and token replace (also under Ring and CFG), the 1.5 1080p super-resolution model (98 channels, meanflow
timestep_r), detection, release headers, LoRA on fused layers, storage precision, bad inputs; ComfyUI's own
HunyuanVideo where COMFYUI_PATH is set (1.5: test_hunyuan_video15_comfyui.py); our key plan equals diffusers'
converter at the 13B width."""
from __future__ import annotations

import pytest
import torch

from family_support import FP32_TOL, LocalContext, assert_parity, relative_error
from sp_lab.conformance.cases import hunyuan_video_cases as make_cases
from sp_runtime.config import SPConfig
from sp_lab.references.hunyuan_video import reference_forward as hunyuan_video_reference
from sp_lab.references.hunyuan_video15 import reference_forward as hunyuan_video15_reference
from sp_runtime.families import hunyuan_video, hunyuan_video15
from sp_runtime.checkpoints.header import Header, read_checkpoint_header
from sp_runtime.groups import build_groups
from sp_lab.tiny_models import COMFY_PREFIX, randomize_
from sp_lab.tiny_models.hunyuan_video import build_tiny_model, write_tiny_checkpoint

pytest_plugins = ["family_pools"]  # the shared per-degree worker pools
SEED = 13
FILES = {  # name -> write_tiny_checkpoint arguments
    "t2v": dict(prefix=COMFY_PREFIX), "i2v": dict(variant="i2v"), "replace": dict(variant="no_guidance"),
    "diffusers": dict(layout="diffusers"),
    "v15": dict(version="1.5", prefix=COMFY_PREFIX), "v15_split": dict(version="1.5", qkv="split"),
    "v15_folder": dict(version="1.5", layout="diffusers_folder"),
    "v15_sr": dict(version="1.5", variant="sr", prefix=COMFY_PREFIX),
    "v15_capybara": dict(version="1.5", prefix=COMFY_PREFIX, capybara=True),
}
REFERENCE_OF = {"t2v": "t2v", "diffusers": "t2v", "i2v": "i2v", "replace": "replace", "v15": "v15",
                "v15_split": "v15", "v15_folder": "v15", "v15_sr": "v15_sr", "v15_capybara": "v15"}


def sr_cases() -> dict:
    """The super-resolution model's calls: the 1.5 cases with the sampler's next sigma (x 1000) as timestep_r."""
    cases = make_cases(98, "1.5", seed=5)
    return {name: (x, t, {**inputs, "timestep_r": torch.tensor(250.0)} if name != "3_tokens_batch_1" else inputs)
            for name, (x, t, inputs) in cases.items() if name not in ("35_tokens", "ref_latent")}


CASES = {"t2v": lambda: make_cases(16), "v15": lambda: make_cases(65, "1.5"),
         "i2v": lambda: {name: case for name, case in make_cases(33).items() if name != "ref_latent"},
         "v15_sr": sr_cases,
         "replace": lambda: {name: (x, t, {**inputs, "guiding_frame_index": torch.zeros(x.shape[0])})
                             for name, (x, t, inputs) in make_cases(16).items()
                             if x.shape[2] > 1 and "ref_latent" not in inputs}}


def comparable(output: torch.Tensor, name: str) -> torch.Tensor:
    """Token replace: frames after the first (diffusers' final layer ignores the first frame's token-replace
    modulation that ComfyUI applies; test_comfyui_parity checks the first frame against ComfyUI's model)."""
    return output[:, :, 1:] if name == "replace" else output


def _write(path: str, layout: str = "original", prefix: str = "", variant: str = "", capybara: bool = False,
           **kwargs) -> str:
    write_tiny_checkpoint(path, layout, "float32", SEED, prefix, variant, **kwargs)
    return _add_capybara_tables(path, prefix) if capybara else path


def _add_capybara_tables(path: str, prefix: str) -> str:
    """Capybara v0.1's file: HunyuanVideo 1.5's plus its three embedding tables (random, nonzero: read, they would
    change nothing ComfyUI computes, but loading them as weights would fail the unknown-key check)."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    with safe_open(path, "pt") as handle:
        tensors, metadata = {key: handle.get_tensor(key) for key in handle.keys()}, handle.metadata()
    hidden = tensors[f"{prefix}img_in.proj.weight"].shape[0]
    generator = torch.Generator().manual_seed(3)
    for key, rows in zip(hunyuan_video15.CAPYBARA_EXTRAS, (4, 2, 10)):
        tensors[prefix + key] = torch.randn(rows, hidden, generator=generator)
    save_file(tensors, path, metadata)
    return path


@pytest.fixture(scope="session")
def hv_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hunyuan_video")
    return {name: _write(str(folder / (name if "folder" in name else f"{name}.safetensors")), **arguments)
            for name, arguments in FILES.items()}


@pytest.fixture(scope="session")
def hv_references():
    """Stock diffusers outputs of in-memory models (independent of our loader, key plan and SP forward)."""
    models = {"t2v": (build_tiny_model(SEED), hunyuan_video_reference),
              "i2v": (build_tiny_model(SEED, variant="i2v"), hunyuan_video_reference),
              "replace": (build_tiny_model(SEED, variant="no_guidance", image_condition_type="token_replace"),
                          hunyuan_video_reference),
              "v15": (build_tiny_model(SEED, "1.5"), hunyuan_video15_reference),
              "v15_sr": (build_tiny_model(SEED, "1.5", "sr"), hunyuan_video15_reference)}
    return {kind: {name: reference(model, x, t, **inputs) for name, (x, t, inputs)
                   in CASES[kind]().items()} for kind, (model, reference) in models.items()}


def check_file(handle, name: str, references, label: str, cases=None) -> None:
    kind = REFERENCE_OF[name]
    for case, (x, t, inputs) in CASES[kind]().items():
        if cases is None or case in cases:
            assert_parity(comparable(handle(x, t, **inputs), kind), comparable(references[kind][case], kind),
                          "float32", f"hunyuan_{label}/{name}/{case}")


# The variants the conformance suite does not run (it runs 1.0 T2V and 1.5 in every layout); each at one degree > 1
DEGREES_OF = {"i2v": (1, 2), "replace": (1, 4), "v15_sr": (1, 2, 3, 4), "v15_capybara": (2,)}


def test_fp32_parity_variants(family_pool, hv_files, hv_references):
    world = family_pool.config.world_size
    for name, degrees in DEGREES_OF.items():
        if world not in degrees:
            continue
        handle = family_pool.load_model(hv_files[name])
        assert handle.info.family == ("hunyuan_video15" if name.startswith("v15") else "hunyuan_video")
        assert handle.info.variant == {"v15_sr": "sr", "i2v": "i2v", "replace": "t2v", "v15_capybara": ""}[name]
        check_file(handle, name, hv_references, f"u{world}")
        handle.unload()


def test_token_replace_under_ring_and_cfg_layouts(layout_pool, hv_files, hv_references):
    """Ring 3 (two merges: the running LSE matters), Ulysses 2 x Ring 2 and Ulysses 2 x CFG 2 (each CFG rank computes
    one half of the batch) on the token-replace model (the suite runs T2V and 1.5 there)."""
    layout, pool = layout_pool
    handle = pool.load_model(hv_files["replace"])
    check_file(handle, "replace", hv_references, layout)
    handle.unload()


def test_the_cases_exercise_what_they_claim(hv_references):
    """Guards against a test that cannot fail: guidance, token replace, the I2V channels, the 1.5 image and glyph
    tokens, the reference latent and the SR model's timestep_r each change the output."""
    t2v, refs = build_tiny_model(SEED), hv_references
    x, t, inputs = CASES["t2v"]()["105_tokens"]
    other = hunyuan_video_reference(t2v, x, t, **{**inputs, "guidance": torch.tensor([1.0, 1.0])})
    assert relative_error(other, refs["t2v"]["105_tokens"]) > 100 * FP32_TOL
    plain = hunyuan_video_reference(build_tiny_model(SEED, variant="no_guidance"), x, t,
                                            **{k: v for k, v in inputs.items() if k != "guidance"})
    assert relative_error(plain[:, :, 1:], refs["replace"]["105_tokens"][:, :, 1:]) > 100 * FP32_TOL
    x, t, inputs = CASES["v15"]()["i2v_glyphs"]
    text_only = hunyuan_video15_reference(build_tiny_model(SEED, "1.5"), x, t, inputs["context"])
    assert relative_error(text_only, refs["v15"]["i2v_glyphs"]) > 100 * FP32_TOL
    assert relative_error(refs["v15"]["105_tokens"], refs["v15"]["ref_latent"]) > 100 * FP32_TOL
    x, t, inputs = sr_cases()["105_tokens"]
    no_r = hunyuan_video15_reference(build_tiny_model(SEED, "1.5", "sr"), x, t, inputs["context"])
    assert relative_error(no_r, refs["v15_sr"]["105_tokens"]) > 100 * FP32_TOL


def test_detection(hv_files, tmp_path):
    expected = {"t2v": ("hunyuan_video", "t2v", "original", COMFY_PREFIX),
                "i2v": ("hunyuan_video", "i2v", "original", ""),
                "replace": ("hunyuan_video", "t2v", "original", ""),
                "diffusers": ("hunyuan_video", "t2v", "diffusers", ""),
                "v15": ("hunyuan_video15", "", "original", COMFY_PREFIX),
                "v15_split": ("hunyuan_video15", "", "original", ""),
                "v15_folder": ("hunyuan_video15", "", "diffusers", ""),
                "v15_sr": ("hunyuan_video15", "sr", "original", COMFY_PREFIX),
                "v15_capybara": ("hunyuan_video15", "", "original", COMFY_PREFIX)}
    for name, path in hv_files.items():
        header = read_checkpoint_header(path)
        found = [module.detect(header) for module in (hunyuan_video, hunyuan_video15)]
        detection = found[name.startswith("v15")]
        assert found[not name.startswith("v15")] is None
        assert (detection.family, detection.variant, detection.layout, detection.prefix) == expected[name]
        assert (detection.config["num_attention_heads"], detection.config["attention_head_dim"]) == (3, 128)
        assert detection.config["rope_axes_dim"] == (16, 56, 56)
    skyreels = _write(str(tmp_path / "skyreels.safetensors"), variant="skyreels_i2v")
    assert hunyuan_video.detect(read_checkpoint_header(skyreels)).variant == "skyreels_i2v"
    assert hunyuan_video.COMFY.model_class("skyreels_i2v") == "HunyuanVideoSkyreelsI2V"


def _release_header(version: str) -> Header:
    """Header of a full-size release in Tencent's names: 1.0 (24 x 128, 20 + 40 blocks), 1.5 (16 x 128, 54)."""
    width, heads = (3072, 24) if version == "1.0" else (2048, 16)
    tensors = {"img_in.proj.weight": (width, 16 if version == "1.0" else 65, 1, 2 if version == "1.0" else 1,
                                      2 if version == "1.0" else 1),
               "final_layer.linear.weight": (64 if version == "1.0" else 32, width),
               "txt_in.input_embedder.weight": (width, 4096 if version == "1.0" else 3584),
               "txt_in.individual_token_refiner.blocks.0.norm1.weight": (width,),
               "txt_in.individual_token_refiner.blocks.1.norm1.weight": (width,)}
    for block in range(20 if version == "1.0" else 54):
        tensors[f"double_blocks.{block}.img_attn_q_norm.weight"] = (128,)
        tensors[f"double_blocks.{block}.img_mlp.fc1.weight"] = (4 * width, width)
    if version == "1.0":
        tensors.update({f"single_blocks.{block}.linear1.weight": (7 * width, width) for block in range(40)})
        tensors.update({"vector_in.in_layer.weight": (width, 768), "guidance_in.mlp.0.weight": (width, 256)})
    else:
        tensors.update({"cond_type_embedding.weight": (3, width), "byt5_in.fc1.weight": (2048, 1472),
                        "vision_in.proj.0.weight": (1152,)})
    return Header("release.safetensors", {key: ("BF16", shape) for key, shape in tensors.items()})


def test_release_headers():
    v10 = hunyuan_video.detect(_release_header("1.0")).config
    assert (v10["num_attention_heads"], v10["num_layers"], v10["num_single_layers"], v10["patch_size"],
            v10["guidance_embeds"], v10["text_embed_dim"], v10["pooled_projection_dim"]) == (24, 20, 40, 2, True,
                                                                                           4096, 768)
    v15 = hunyuan_video15.detect(_release_header("1.5")).config
    assert (v15["num_attention_heads"], v15["num_layers"], v15["in_channels"], v15["out_channels"],
            v15["text_embed_dim"], v15["text_embed_2_dim"], v15["image_embed_dim"]) == (16, 54, 65, 32, 3584, 1472,
                                                                                       1152)
    assert hunyuan_video15.detect(_release_header("1.0")) is None
    header = _release_header("1.5")
    header.tensors.update({"time_r_in.mlp.0.weight": ("BF16", (2048, 256)),
                           "img_in.proj.weight": ("BF16", (2048, 98, 1, 1, 1))})
    sr = hunyuan_video15.detect(header)
    assert (sr.variant, sr.config["in_channels"], sr.config["use_meanflow"]) == ("sr", 98, True)
    assert hunyuan_video15.COMFY.model_class(sr.variant) == "HunyuanVideo15_SR_Distilled"


def test_sampler_inputs_give_the_next_sigma():
    """The host's meanflow input, as ComfyUI's model finds it: the sigma after the current one in the schedule,
    x 1000; nothing when the current sigma is not in the schedule, the schedule is missing or the call disables it."""
    schedule = torch.tensor([1.0, 0.75, 0.5, 0.0])
    options = {"sigmas": torch.tensor([0.75, 0.75]), "sample_sigmas": schedule}
    assert torch.equal(hunyuan_video15.sampler_inputs(options, {})["timestep_r"], torch.tensor(500.0))
    assert hunyuan_video15.sampler_inputs({**options, "sigmas": torch.tensor([0.6])}, {}) == {}
    assert hunyuan_video15.sampler_inputs({}, {}) == {}
    assert hunyuan_video15.sampler_inputs(options, {"disable_time_r": True}) == {}


def test_key_plan_equals_diffusers_converter_at_13b_width():
    """Tencent's fused tensors at the released width (3072; diffusers' converter hardcodes it), rows tagged by
    index (views: no real memory)."""
    from diffusers.loaders.single_file_utils import convert_hunyuan_video_transformer_to_diffusers
    width = 3072

    def tagged(rows, columns=1):
        return torch.arange(rows, dtype=torch.float32)[:, None].expand(-1, columns)
    checkpoint = {"double_blocks.0.img_attn_qkv.weight": tagged(3 * width), "double_blocks.0.txt_attn_qkv.bias":
                  tagged(3 * width)[:, 0], "double_blocks.3.img_attn_q_norm.weight": tagged(128)[:, 0],
                  "double_blocks.0.txt_mlp.fc2.weight": tagged(width, 4), "double_blocks.1.img_mod.linear.weight":
                  tagged(6 * width), "single_blocks.7.linear1.weight": tagged(7 * width),
                  "single_blocks.7.linear1.bias": tagged(7 * width)[:, 0], "single_blocks.2.k_norm.weight":
                  tagged(128)[:, 0], "single_blocks.2.modulation.linear.bias": tagged(3 * width)[:, 0],
                  "final_layer.adaLN_modulation.1.weight": tagged(2 * width), "time_in.mlp.0.weight": tagged(width),
                  "vector_in.out_layer.bias": tagged(width)[:, 0], "guidance_in.mlp.2.weight": tagged(width),
                  "txt_in.t_embedder.mlp.2.weight": tagged(width), "txt_in.c_embedder.linear_1.bias":
                  tagged(width)[:, 0], "txt_in.individual_token_refiner.blocks.1.self_attn_qkv.weight":
                  tagged(3 * width), "txt_in.individual_token_refiner.blocks.0.mlp.fc1.bias": tagged(4 * width)[:, 0],
                  "txt_in.individual_token_refiner.blocks.1.adaLN_modulation.1.weight": tagged(2 * width),
                  "txt_in.input_embedder.weight": tagged(width), "img_in.proj.bias": tagged(width)[:, 0]}
    want = convert_hunyuan_video_transformer_to_diffusers(dict(checkpoint))
    config = {"num_attention_heads": 24, "attention_head_dim": 128, "mlp_ratio": 4.0}
    got = {name: transform(checkpoint[source]) if transform else checkpoint[source]
           for source, targets in hunyuan_video.original_plan(checkpoint, config).items()
           for name, transform in targets}
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[name], want[name]) for name in want)


def test_bad_inputs_are_clear_errors(hv_files):
    """In one process (the pool's handling of worker errors is tested elsewhere)."""
    from sp_runtime.contract import LoadRequest
    from sp_runtime.pool.loading import load_worker_model
    groups = build_groups(SPConfig(["cpu"]))
    worker = load_worker_model(LoadRequest(hv_files["t2v"]), torch.device("cpu"), groups, lambda *_: None)
    x, t, inputs = CASES["t2v"]()["35_tokens"]
    out = torch.empty(x.shape)
    bad = {"multiples of": (x[..., :9], inputs), "CLIP pooled": (x, {k: v for k, v in inputs.items() if k != "y"}),
           "ref_latent has shape": (x, {**inputs, "ref_latent": x[:, :8]}),
           "context": (x, {**inputs, "context": x[:, 0, 0]}),
           "first frame": (x, {**inputs, "ref_latent": x, "guiding_frame_index": torch.zeros(2)})}
    for message, (latent, call) in bad.items():
        with pytest.raises(ValueError, match=message):
            worker.forward(latent, t, call, out[..., :latent.shape[-1]], LocalContext(groups))
    worker = load_worker_model(LoadRequest(hv_files["v15"]), torch.device("cpu"), groups, lambda *_: None)
    x, t, inputs = CASES["v15"]()["ref_latent"]
    out = torch.empty(2, 32, *x.shape[2:])
    for message, reference in {"ref_latent has shape .* 65": x[:, :32],
                               "batch 3": x[:1].expand(3, -1, -1, -1, -1)}.items():
        with pytest.raises(ValueError, match=message):
            worker.forward(x, t, {**inputs, "ref_latent": reference}, out, LocalContext(groups))


# ---------------------------------------------------------------------------------------------------------------
# ComfyUI's own model (only where COMFYUI_PATH points at a ComfyUI checkout)

def _comfy_hunyuan_video(in_channels: int):
    """ComfyUI's HunyuanVideo network at the tiny size (its 1.5 fields off where this ComfyUI has them)."""
    import dataclasses
    import comfy.ldm.hunyuan_video.model as comfy_hv
    import comfy.ops
    fields = {field.name for field in dataclasses.fields(comfy_hv.HunyuanVideoParams)}
    newer = {key: value for key, value in dict(use_cond_type_embedding=False, vision_in_dim=None,
                                                meanflow_sum=False).items() if key in fields}
    model = comfy_hv.HunyuanVideo(in_channels=in_channels, out_channels=16, vec_in_dim=24, context_in_dim=32,
                                  hidden_size=384, mlp_ratio=2.0, num_heads=3, depth=1, depth_single_blocks=1,
                                  axes_dim=[16, 56, 56], theta=256, patch_size=[1, 2, 2], qkv_bias=True,
                                  guidance_embed=True, byt5=False, meanflow=False, dtype=torch.float32, device="cpu",
                                  operations=comfy.ops.disable_weight_init, **newer)
    randomize_(model, SEED + 1)
    return model


def test_comfyui_parity(family_pool, tmp_path):
    """ComfyUI-named files of ComfyUI's own network; padding masks, token replace and a reference latent at batch 1
    (ComfyUI's HunyuanVideo supports them only there)."""
    from comfy_support import NO_COMFYUI, comfyui_path, import_comfy, import_node_module
    if comfyui_path() is None:
        pytest.skip(NO_COMFYUI)
    if family_pool.config.world_size not in (2, 4):
        pytest.skip("ComfyUI's HunyuanVideo is compared at degrees 2 and 4 (heads not divisible by the degree)")
    import_comfy()
    from safetensors.torch import save_file
    import comfy.supported_models
    for channels, comfy_class in ((16, "HunyuanVideo"), (33, "HunyuanVideoI2V")):
        model = _comfy_hunyuan_video(channels)
        path = str(tmp_path / f"comfy_hunyuan_video_{channels}.safetensors")
        save_file({COMFY_PREFIX + key: value.contiguous() for key, value in model.state_dict().items()}, path)
        handle = family_pool.load_model(path)
        config = import_node_module("comfy_model").comfy_model_config(read_checkpoint_header(path), handle.info)
        assert type(config) is getattr(comfy.supported_models, comfy_class)
        x, t, inputs = make_cases(channels)["105_tokens"]
        reference = make_cases(channels)["ref_latent"][2]["ref_latent"]
        one = {key: value[:1] for key, value in inputs.items()}
        calls = {"t2v": (x, t, inputs), "no_guidance": (x, t, {k: v for k, v in inputs.items() if k != "guidance"}),
                 "padding_mask": (x[:1], t[:1], {**one, "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0, 0]])}),
                 "token_replace": (x[:1], t[:1], {**one, "guiding_frame_index": torch.tensor([0.0])}),
                 "ref_latent": (x[:1], t[:1], {**one, "ref_latent": reference[:1]})}
        for name, (latent, timestep, call) in calls.items():
            call = dict(call)
            context = call.pop("context")
            with torch.no_grad():
                expected = model(latent, timestep, context, transformer_options={}, **call)
            assert_parity(handle(latent, timestep, context=context, **call), expected, "float32",
                          f"comfyui_hunyuan/{channels}/{name}")
        handle.unload()


def test_lora_on_fused_layers_splits_like_the_weights(hv_files, tmp_path):
    """LoRAs by ComfyUI's names (double block img_attn.qkv) and Tencent's (single block linear1: q, k, v and the
    MLP rows) reach the split diffusers parameters through the loader's key plan; removing them is exact."""
    from safetensors.torch import save_file
    from sp_runtime.lora.apply import LoraState
    path = hv_files["replace"]
    model = hunyuan_video.load_model(path, "float32")[0]
    before = {name: value.clone() for name, value in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    width, mlp, rank, alpha, strength = 384, 768, 4, 2.0, 0.7
    stems = {"diffusion_model.double_blocks.0.img_attn.qkv": 3 * width,
             "diffusion_model.single_blocks.0.linear1": 3 * width + mlp}
    lora, deltas = {}, {}
    for stem, rows in stems.items():
        up, down = torch.randn(rows, rank, generator=g), torch.randn(rank, width, generator=g)
        lora.update({f"{stem}.lora_B.weight": up, f"{stem}.lora_A.weight": down, f"{stem}.alpha": torch.tensor(alpha)})
        deltas[stem] = strength * alpha / rank * (up @ down)
    lora_path = str(tmp_path / "hunyuan_lora.safetensors")
    save_file(lora, lora_path)
    state = LoraState(model, "hunyuan_video", path, torch.device("cpu"))
    assert state.set([[lora_path, strength]])["parameters"] == 7
    after = model.state_dict()
    parts = {"diffusion_model.double_blocks.0.img_attn.qkv": [f"transformer_blocks.0.attn.to_{p}" for p in "qkv"],
             "diffusion_model.single_blocks.0.linear1": [f"single_transformer_blocks.0.attn.to_{p}" for p in "qkv"]
             + ["single_transformer_blocks.0.proj_mlp"]}
    for stem, names in parts.items():
        start = 0
        for name in names:
            rows = before[f"{name}.weight"].shape[0]
            expected = before[f"{name}.weight"] + deltas[stem][start:start + rows]
            assert relative_error(after[f"{name}.weight"], expected) <= 1e-6, name
            start += rows
    state.set([])
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())


@pytest.mark.parametrize("version, dtype", [("1.0", "bfloat16"), ("1.5", "bfloat16"), ("1.5", "float8_e4m3fn")])
def test_low_precision_storage(tmp_path, version, dtype):
    """bf16 and fp8 files (kept in fp8, computed in bf16) within their rounding of diffusers' stock forward on the
    same weights and dtypes; in one process (the split is dtype-blind and checked in fp32 above)."""
    from sp_runtime.contract import LoadRequest
    from sp_runtime.pool.loading import load_worker_model
    module = hunyuan_video15 if version == "1.5" else hunyuan_video
    path = write_tiny_checkpoint(str(tmp_path / f"{dtype}.safetensors"), "original", dtype, SEED, COMFY_PREFIX, "",
                                 version=version)
    if dtype == "bfloat16":
        reference = build_tiny_model(SEED, version).to(torch.bfloat16)
    else:  # the same file through diffusers' own fp8 layerwise casting
        reference = module.load_model(path)[0]
    groups = build_groups(SPConfig(["cpu"]))
    worker = load_worker_model(LoadRequest(path), torch.device("cpu"), groups, lambda *_: None)
    assert (worker.info.weight_dtype, worker.info.compute_dtype) == (dtype, "bfloat16")
    x, _, inputs = CASES["v15" if version == "1.5" else "t2v"]()["105_tokens"]
    t = torch.tensor([704.0, 304.0])  # exact in bf16 (diffusers' 1.5 embeds timesteps in the compute dtype)
    x, inputs = x.to(torch.bfloat16), {key: value.to(torch.bfloat16) if key == "context" else value
                                       for key, value in inputs.items()}
    out = torch.full(x.shape[:1] + (worker.info.out_channels,) + x.shape[2:], float("nan"), dtype=x.dtype)
    with torch.no_grad():
        worker.forward(x, t, inputs, out, LocalContext(groups))
    expected = (hunyuan_video15_reference if version == "1.5" else hunyuan_video_reference)(reference, x, t, **inputs)
    assert_parity(out, expected, dtype, f"hunyuan_{version}/{dtype}")


def test_norm_names_of_newer_comfyui_meet_the_released_names():
    """Files saved by newer ComfyUI (0.33 on) name the q / k norms `.weight`, releases and older ComfyUI `.scale`."""
    from sp_runtime.families.hunyuan_video.keys import comfy_name
    for block in ("double_blocks.0.img_attn", "double_blocks.1.txt_attn", "single_blocks.0"):
        for norm in ("query_norm", "key_norm"):
            assert comfy_name(f"{block}.norm.{norm}.weight") == comfy_name(f"{block}.norm.{norm}.scale") == \
                f"{block}.norm.{norm}.scale"
