"""Wan 2.1 / 2.2 beyond the conformance suite (tests/families/test_family_conformance.py runs T2V at every degree,
layout and file layout on sp_lab.conformance.cases.wan_cases: token counts the degree does not divide, ranks without
tokens, batch 2, an appended frame): the variants (I2V with clip_fea, FLF2V, A14B-style I2V, TI2V 5B-style with
per-frame timesteps, also under Ring and CFG), fewer heads than ranks, the head size option, bf16 / fp16 / fp8 storage
within their rounding, key conversion, ComfyUI's own WanModel where present."""
from __future__ import annotations

import pytest
import torch

from family_support import assert_parity, at_worlds, relative_error, single_rank_worker
from sp_lab.references.wan import reference_forward
from sp_runtime.families import wan
from sp_runtime.sp.video_tokens import VideoGrid, pad_to_patch_3d
from sp_lab.tiny_models import COMFY_PREFIX, build_tiny_model, randomize_, write_tiny_checkpoint
from sp_lab.tiny_models.wan import original_state_dict
from sp_lab.conformance.cases import wan_cases as make_cases

pytest_plugins = ["family_pools"]  # the shared per-degree and per-layout worker pools
SEED = 3
CONFORMANCE_SEED = 5  # the conformance suite's tiny Wan (sp_lab.conformance.product)
TEXT_DIM = 32
# name -> write_tiny_checkpoint arguments
T2V_FILES = {"original": dict(), "comfy_prefix_no_metadata": dict(prefix=COMFY_PREFIX, head_dim_metadata=False),
             "diffusers_file": dict(layout="diffusers")}
VARIANT_FILES = {"i2v": dict(variant="i2v", prefix=COMFY_PREFIX), "flf2v": dict(variant="flf2v"),
                 "i2v_concat": dict(variant="i2v_concat"), "ti2v": dict(variant="ti2v"),
                 "heads3": dict(num_attention_heads=3)}
LOW_PRECISION = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")


VARIANT_CASES = {
    "i2v": lambda: make_cases(36, text_tokens=512, clip_tokens=5),
    "flf2v": lambda: make_cases(36, text_tokens=512, clip_tokens=10),
    "i2v_concat": lambda: make_cases(36),
    "ti2v": lambda: {**make_cases(48, per_frame=True),
                     "shared_timestep": make_cases(48, seed=2)["45_tokens"]},
    "heads3": lambda: make_cases(),
}
VARIANT_SIZES = {"heads3": dict(num_attention_heads=3)}


@pytest.fixture(scope="session")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wan")
    paths = {}
    for name, arguments in {**T2V_FILES, **VARIANT_FILES}.items():
        paths[name] = write_tiny_checkpoint("wan", str(folder / f"{name}.safetensors"), seed=SEED, **arguments)
    for dtype in LOW_PRECISION:
        paths[dtype] = write_tiny_checkpoint("wan", str(folder / f"{dtype}.safetensors"), dtype=dtype, seed=SEED)
    return paths


@pytest.fixture(scope="session")
def references(files):
    """Stock diffusers outputs: fp32 from in-memory models (independent of our loader and key plan); low
    precision from the same file loaded in-process with the same dtype policy."""
    refs = {"t2v": _outputs(build_tiny_model("wan", SEED), make_cases())}
    for name, cases in VARIANT_CASES.items():
        variant = name if name != "heads3" else "t2v"
        model = build_tiny_model("wan", SEED, variant=variant, **VARIANT_SIZES.get(name, {}))
        refs[name] = _outputs(model, cases())
    for dtype in LOW_PRECISION:
        refs[dtype] = _outputs(wan.load_model(files[dtype])[0], _low_precision_cases())
    return refs


def _outputs(model, cases: dict) -> dict:
    return {name: reference_forward(model, x, t, **inputs) for name, (x, t, inputs) in cases.items()}


def _low_precision_cases() -> dict:
    cases = make_cases()
    x, t, inputs = cases["45_tokens"]
    cases["bf16_latent"] = (x.to(torch.bfloat16), t, {"context": inputs["context"].to(torch.bfloat16)})
    return cases


def _degree(pool) -> int:
    return len(pool.config.devices)


@at_worlds(2)
def test_a_file_without_head_size_metadata_loads_with_the_option(family_pool, family_subject, tmp_path):
    """ComfyUI's Wan files carry no head size: the head_dim option gives it (the suite's files carry it)."""
    subject = family_subject("wan")
    path = write_tiny_checkpoint("wan", str(tmp_path / "no_metadata.safetensors"), seed=CONFORMANCE_SEED,
                                 prefix=COMFY_PREFIX, head_dim_metadata=False)
    handle = family_pool.load_model(path, head_dim=16)
    assert (handle.info.family, handle.info.variant, handle.info.weight_dtype) == ("wan", "t2v", "float32")
    assert handle.info.config["dim"] == 96 and handle.info.config["num_heads"] == 6
    handle.unload()
    subject.check(family_pool, path, "no_head_size_metadata", head_dim=16)


# the cases whose token split differs from T2V's: per-frame timesteps (TI2V) and heads the degree does not divide
SPLIT_CASES = {"ti2v": None, "heads3": ("45_tokens", "1_token_batch_1")}


@pytest.mark.parametrize("variant", sorted(VARIANT_CASES))
def test_fp32_parity_variants(family_pool, files, references, variant):
    """I2V with clip_fea, FLF2V, A14B-style I2V, TI2V 5B-style per-frame timesteps, 3 heads on up to 4 ranks."""
    handle = family_pool.load_model(files[variant])
    names = SPLIT_CASES.get(variant, ("45_tokens",))
    for name, (x, t, inputs) in VARIANT_CASES[variant]().items():
        if names is None or name in names:
            assert_parity(handle(x, t, **inputs), references[variant][name], "float32", f"{variant}/{name}")


def test_low_precision_storage(family_pool, files, references):
    """Storage precision does not depend on the split: checked at degree 2."""
    if _degree(family_pool) != 2:
        pytest.skip("checked at degree 2 (suite time)")
    pool = family_pool
    for dtype in LOW_PRECISION:
        handle = pool.load_model(files[dtype])
        assert handle.info.weight_dtype == dtype
        assert handle.info.compute_dtype == ("float16" if dtype == "float16" else "bfloat16")
        for name, (x, t, inputs) in _low_precision_cases().items():
            assert_parity(handle(x, t, **inputs), references[dtype][name], dtype, f"{dtype}/{name}")


def test_the_cases_exercise_what_they_claim(references):
    """Guards against a test that cannot fail: per-frame timesteps, CLIP features, appended frames and storage
    precision each change the output."""
    ti2v = build_tiny_model("wan", SEED, variant="ti2v")
    x, t, inputs = VARIANT_CASES["ti2v"]()["45_tokens"]
    shared = reference_forward(ti2v, x, t[:, -1], **inputs)
    assert relative_error(shared, references["ti2v"]["45_tokens"]) > 1e-3
    i2v = build_tiny_model("wan", SEED, variant="i2v")
    x, t, inputs = VARIANT_CASES["i2v"]()["45_tokens"]
    other_clip = reference_forward(i2v, x, t, inputs["context"], clip_fea=torch.zeros_like(inputs["clip_fea"]))
    assert relative_error(other_clip, references["i2v"]["45_tokens"]) > 1e-3
    x, t, inputs = make_cases()["time_dim_concat"]
    alone = reference_forward(build_tiny_model("wan", SEED), x, t, inputs["context"])
    assert relative_error(alone, references["t2v"]["time_dim_concat"]) > 1e-3
    assert relative_error(references["bfloat16"]["45_tokens"], references["t2v"]["45_tokens"]) > 1e-4


def test_ring_and_cfg_layouts(layout_pool, files, references):
    """Ring only, Ulysses x Ring (hybrid attention) and Ulysses inside CFG halves, incl. an odd batch over all
    ranks."""
    layout, pool = layout_pool
    handle = pool.load_model(files["ti2v"])
    cases = VARIANT_CASES["ti2v"]()
    for name in ("45_tokens", "1_token_batch_1", "time_dim_concat"):
        x, t, inputs = cases[name]
        assert_parity(handle(x, t, **inputs), references["ti2v"][name], "float32", f"{layout}/{name}")


# ---------------------------------------------------------------------------------------------------------------
# In-process checks (no pool)

def test_key_plan_equals_diffusers_converter():
    """Our per-tensor plan gives what diffusers' whole-state-dict converter gives, on every key of a full-size
    Wan 2.1 I2V 14B (meta tensors) and on a tiny model's real tensors."""
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
    from sp_runtime.families.wan.keys import wan_key_plan
    with init_empty_weights():
        full = WanTransformer3DModel(num_attention_heads=40, attention_head_dim=128, in_channels=36, ffn_dim=13824,
                                     num_layers=40, image_dim=1280, added_kv_proj_dim=5120)
    for model in (full, build_tiny_model("wan", SEED, variant="i2v")):
        original = original_state_dict(model)
        expected = convert_wan_transformer_to_diffusers({COMFY_PREFIX + k: v for k, v in original.items()})
        plan = wan_key_plan(original)
        assert set(plan) == set(original), "every original key has a destination"
        ours = {target: original[source] for source, targets in plan.items() for target, _ in targets}
        assert ours.keys() == expected.keys() == model.state_dict().keys()
        if model is not full:
            assert all(torch.equal(ours[key], expected[key]) for key in expected)
    assert wan_key_plan(["img_emb.emb_pos"]) == {"img_emb.emb_pos": [
        ("condition_embedder.image_embedder.pos_embed", None)]}  # the converter leaves FLF2V's positions out


def test_fp8_weights_stay_fp8_with_norms_and_embeddings_in_bf16(files):
    model, _, dtypes = wan.load_model(files["float8_e4m3fn"])
    block = model.blocks[0]
    assert dtypes.layerwise
    assert block.attn1.to_q.weight.dtype == torch.float8_e4m3fn and block.ffn.net[2].weight.dtype == \
        torch.float8_e4m3fn
    assert block.attn1.norm_q.weight.dtype == torch.bfloat16 and block.scale_shift_table.dtype == torch.bfloat16
    assert model.patch_embedding.weight.dtype == torch.bfloat16
    assert model.condition_embedder.time_proj.weight.dtype == torch.bfloat16
    upcast = wan.load_model(files["float8_e4m3fn"], dtype="bfloat16")[0]
    assert upcast.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16


def test_head_size_option_and_its_errors(files):
    model = wan.load_model(files["comfy_prefix_no_metadata"], options={"head_dim": 16})[0]
    assert (model.config.attention_head_dim, model.config.num_attention_heads) == (16, 6)
    model = wan.load_model(files["original"], options={"head_dim": 32})[0]  # the option overrides the metadata
    assert (model.config.attention_head_dim, model.config.num_attention_heads) == (32, 3)
    with pytest.raises(ValueError, match="not a multiple of Wan's head size 128: load it with the option head_dim"):
        wan.load_model(files["comfy_prefix_no_metadata"])
    with pytest.raises(ValueError, match="head_dim=20 does not fit a Wan model 96 wide"):
        wan.load_model(files["original"], options={"head_dim": 20})


def test_loading_reports_progress_and_names_bad_weights(files, tmp_path):
    from safetensors.torch import load_file, save_file
    seen = []
    wan.load_model(files["original"], progress=lambda fraction, message: seen.append(fraction))
    assert seen == sorted(seen) and seen[-1] == 1.0 and len(seen) > 3
    state = load_file(files["original"])
    state.pop("blocks.1.cross_attn.k.bias")
    save_file(state, str(tmp_path / "broken.safetensors"), metadata={"ulysses_sp.head_dim": "16"})
    with pytest.raises(ValueError, match=r"missing \(e\.g\. \['blocks\.1\.attn2\.to_k\.bias'\]\)"):
        wan.load_model(str(tmp_path / "broken.safetensors"))


def test_diffusers_files_may_carry_the_unused_norm_added_q(files, tmp_path):
    """Some released diffusers Wan I2V files hold attn2.norm_added_q, which WanTransformer3DModel does not use."""
    from safetensors.torch import load_file, save_file
    state = load_file(files["diffusers_file"])
    state["blocks.0.attn2.norm_added_q.weight"] = torch.ones(96)
    path = str(tmp_path / "with_norm_added_q.safetensors")
    save_file(state, path, metadata={"ulysses_sp.head_dim": "16"})
    model = wan.load_model(path)[0]
    assert "blocks.0.attn2.norm_added_q.weight" not in model.state_dict()


def test_causal_forcing_files_are_refused_by_name(files, tmp_path):
    """The templates' causal_forcing-framewise: Wan 2.1 T2V weights whose ComfyUI metadata says causal_ar (ComfyUI's
    CausalWanModel, sampled block by block against a KV cache by SamplerARVideo); the same file without it loads."""
    import json
    from safetensors.torch import load_file, save_file
    from sp_runtime.detection import detect
    from sp_runtime.checkpoints.header import read_checkpoint_header
    state = load_file(files["original"])
    for name, causal in (("causal_forcing-framewise", True), ("plain", False)):
        path = str(tmp_path / f"{name}.safetensors")
        save_file(state, path, metadata={"ulysses_sp.head_dim": "16",
                                         "config": json.dumps({"transformer": {"causal_ar": causal}})})
        if causal:
            with pytest.raises(ValueError, match="is a Wan 2.1 Causal Forcing model .*causal_ar.* not supported"):
                detect(read_checkpoint_header(path))
        else:
            assert detect(read_checkpoint_header(path)).variant == "t2v"


def test_cancel_is_checked_between_blocks_and_bad_inputs_are_named(files):
    worker, context = single_rank_worker(files["original"])
    x, t, inputs = make_cases()["45_tokens"]
    worker.forward(x, t, inputs, torch.empty(worker.info.output_shape(tuple(x.shape))), context)
    assert context.cancel_checks == len(worker.model.blocks)
    with pytest.raises(ValueError, match=r"context \[B, L, 32\]"):
        worker.forward(x, t, {"context": inputs["context"][..., :8]}, torch.empty(x.shape), context)
    with pytest.raises(ValueError, match="vace_context belongs to a Wan variant"):
        worker.forward(x, t, {**inputs, "vace_context": x}, torch.empty(x.shape), context)


def test_video_grid_patches_and_writes_any_token_range():
    """The box decomposition reads and writes exactly the tokens of a range, for ranges that start and stop
    mid-row and mid-frame, against a plain Conv3d-style unfold of the whole (padded) latent."""
    latent = torch.randn(2, 3, 4, 7, 9)
    padded = pad_to_patch_3d(latent, (1, 2, 2))
    assert padded.shape[2:] == (4, 8, 10)  # wrapped around, as ComfyUI pads
    assert torch.equal(padded[:, :, :, 7, :9], latent[:, :, :, 0]) and torch.equal(padded[..., :7, 9],
                                                                                   latent[..., 0])
    grid = VideoGrid.of(tuple(latent.shape[2:]), (1, 2, 2))
    assert (grid.frames, grid.rows, grid.cols, grid.count) == (4, 4, 5, 80)
    every = padded.reshape(2, 3, 4, 4, 2, 5, 2).permute(0, 2, 3, 5, 1, 4, 6).reshape(2, 80, 12)
    out_tokens = every.reshape(2, 80, 3, 2, 2).permute(0, 1, 3, 4, 2).reshape(2, 80, 12)  # (ph, pw, c) order
    for first, stop in [(0, 80), (3, 4), (5, 47), (20, 40), (19, 61), (0, 1), (79, 80), (7, 7)]:
        assert len(grid.boxes(first, stop)) <= 5
        assert torch.equal(grid.patches(padded, first, stop), every[:, first:stop])
        out = torch.full_like(latent, float("nan"))
        grid.write(out, out_tokens[:, first:stop], first)
        written = ~out.isnan()
        assert torch.equal(out[written], latent[written])
        positions = grid.positions(first, stop)
        expected = {(f, r * 2 + dr, c * 2 + dc) for f, r, c in positions.tolist() for dr in (0, 1) for dc in (0, 1)
                    if r * 2 + dr < 7 and c * 2 + dc < 9}
        assert set(map(tuple, written[0, 0].nonzero().tolist())) == expected


# ---------------------------------------------------------------------------------------------------------------
# ComfyUI's own model (only where COMFYUI_PATH points at a ComfyUI checkout)

COMFY_KINDS = {  # name -> (WanModel arguments, cases)
    "t2v": (dict(model_type="t2v", in_dim=16, out_dim=16), lambda: make_cases()),
    "i2v": (dict(model_type="i2v", in_dim=36, out_dim=16), lambda: make_cases(36, clip_tokens=5)),
    "flf2v": (dict(model_type="i2v", in_dim=36, out_dim=16, flf_pos_embed_token_number=10),
              lambda: make_cases(36, clip_tokens=10)),
    "ti2v": (dict(model_type="t2v", in_dim=48, out_dim=48), lambda: make_cases(48, per_frame=True)),
}


@pytest.fixture(scope="session")
def comfyui():
    """ComfyUI's core imported (CPU mode); requested before `pool` so a missing ComfyUI starts no pool."""
    from comfy_support import NO_COMFYUI, comfyui_path, import_comfy
    if comfyui_path() is None:
        pytest.skip(NO_COMFYUI)
    return import_comfy()


def test_comfyui_parity(comfyui, family_pool, tmp_path):
    import comfy.ldm.wan.model as comfy_wan
    import comfy.ops
    from safetensors.torch import save_file
    for kind, (arguments, cases) in COMFY_KINDS.items():
        model = comfy_wan.WanModel(dim=96, ffn_dim=128, text_dim=TEXT_DIM, num_heads=6, num_layers=2,
                                   device="cpu", dtype=torch.float32, operations=comfy.ops.disable_weight_init,
                                   **arguments)
        randomize_(model, SEED + 1)
        path = str(tmp_path / f"comfy_wan_{kind}.safetensors")
        save_file({COMFY_PREFIX + key: value.contiguous() for key, value in model.state_dict().items()}, path)
        handle = family_pool.load_model(path, head_dim=16)
        for name, (x, t, inputs) in cases().items():
            calls = [inputs] + ([{k: v for k, v in inputs.items() if k != "clip_fea"}] if "clip_fea" in inputs
                                else [])  # ComfyUI's image models without clip_fea: the image branch reads text
            for call in calls:
                call = dict(call)
                context = call.pop("context")
                with torch.no_grad():
                    expected = model(x, t, context, transformer_options={}, **call)
                got = handle(x, t, context=context, **call)
                assert_parity(got, expected, "float32", f"comfyui/{kind}/{name}/clip={'clip_fea' in call}")
