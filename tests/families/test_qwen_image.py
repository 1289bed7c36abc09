"""Qwen-Image beyond the conformance suite (tests/families/test_family_conformance.py runs every degree, layout and
file layout on sp_lab.conformance.cases.qwen_image_cases: odd token counts, 6 heads, batch 2, text masks, Edit
reference latents): Edit-2511, bf16 / fp16 / fp8 storage within their rounding, bad reference latents, loading
errors, the token writer; ComfyUI's own model where present."""
from __future__ import annotations

import pytest
import torch

from family_support import FP32_TOL, LocalContext, assert_parity, relative_error, single_rank_worker
from sp_runtime.config import SPConfig
from sp_lab.references.qwen_image import reference_forward as qwen_image_reference
from sp_runtime.families import qwen_image
from sp_runtime.checkpoints.header import read_checkpoint_header
from sp_runtime.sp.tokens import TokenGrid, reference_pack
from sp_lab.conformance.cases import qwen_image_cases as make_cases
from sp_lab.tiny_models import COMFY_PREFIX, build_tiny_model, randomize_, write_tiny_checkpoint

pytest_plugins = ["family_pools"]  # the shared per-degree worker pools
SEED = 3
LOW_PRECISION = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")


@pytest.fixture(scope="session")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen")
    paths = {"original": write_tiny_checkpoint("qwen_image", str(folder / "original.safetensors"), seed=SEED)}
    for dtype in LOW_PRECISION:
        paths[dtype] = write_tiny_checkpoint("qwen_image", str(folder / f"{dtype}.safetensors"), dtype=dtype,
                                             seed=SEED)
    paths["edit_2511"] = write_tiny_checkpoint("qwen_image", str(folder / "edit_2511.safetensors"),
                                               variant="edit_2511", seed=SEED, prefix=COMFY_PREFIX)
    return paths


@pytest.fixture(scope="session")
def references(files):
    """Stock diffusers outputs: fp32 from the in-memory model (independent of our loader and key handling);
    low precision from the same file loaded in-process with the same dtype policy."""
    fp32 = build_tiny_model("qwen_image", SEED)
    refs = {"float32": {name: qwen_image_reference(fp32, *case[:2], **case[2])
                        for name, case in make_cases().items()}}
    edit = build_tiny_model("qwen_image", SEED, zero_cond_t=True)
    refs["edit_2511"] = {name: qwen_image_reference(edit, *case[:2], **case[2])
                         for name, case in make_cases().items()}
    for dtype in LOW_PRECISION:
        model = qwen_image.load_model(files[dtype])[0]
        refs[dtype] = {name: qwen_image_reference(model, *case[:2], **case[2])
                       for name, case in _low_precision_cases(dtype).items()}
    return refs


def _low_precision_cases(dtype: str) -> dict:
    # bf16-exact timesteps: diffusers rounds sigma to the compute dtype, ComfyUI (and we) keep it in float32
    cases = make_cases(timesteps=(0.5, 0.25))
    del cases["edit_offset"], cases["batch_1"], cases["odd_latent"], cases["2_tokens"]
    x, t, inputs = cases["35_tokens_masked"]
    cases["bf16_latent"] = (x.to(torch.bfloat16), t, {**inputs, "context": inputs["context"].to(torch.bfloat16)})
    return cases


def test_bad_reference_latents_fail_on_the_host(family_pool, files):
    """Wrong channels would fail only on the ranks whose tokens the reference reaches (then a restart)."""
    handle = family_pool.load_model(files["original"])
    assert (handle.info.family, handle.info.variant, handle.info.weight_dtype) == ("qwen_image", "image", "float32")
    x, t, inputs = make_cases()["edit_two_refs"]
    calls = family_pool.stats["calls"]
    with pytest.raises(ValueError, match=r"ref_latents\[1\] has shape \[2, 4, 1, 4, 8\]"):
        handle(x, t, **{**inputs, "ref_latents": [inputs["ref_latents"][0], torch.zeros(2, 4, 1, 4, 8)]})
    assert family_pool.stats["calls"] == calls and family_pool.state == "idle"


def test_edit_2511_modulates_references_at_timestep_zero(family_pool, files, references):
    handle = family_pool.load_model(files["edit_2511"])
    assert handle.info.variant == "edit_2511"
    for name, (x, t, inputs) in make_cases().items():
        out = handle(x, t, **inputs)
        assert_parity(out, references["edit_2511"][name], "float32", f"edit_2511/{name}")
    x, t, inputs = make_cases()["edit_two_refs"]
    plain = references["float32"]["edit_two_refs"]
    assert relative_error(handle(x, t, **inputs), plain) > 100 * FP32_TOL, "2511 must differ from plain Edit"


def test_low_precision_storage(family_pool, files, references):
    for dtype in LOW_PRECISION:
        handle = family_pool.load_model(files[dtype])
        assert handle.info.weight_dtype == dtype
        assert handle.info.compute_dtype == ("float16" if dtype == "float16" else "bfloat16")
        for name, (x, t, inputs) in _low_precision_cases(dtype).items():
            assert_parity(handle(x, t, **inputs), references[dtype][name], dtype, f"{dtype}/{name}")


def test_the_mask_and_the_references_matter(references):
    """Guards against a test that cannot fail: the cases really exercise masking and references."""
    cases = make_cases()
    fp32 = build_tiny_model("qwen_image", SEED)
    x, t, inputs = cases["35_tokens_masked"]
    unmasked = qwen_image_reference(fp32, x, t, inputs["context"])
    assert relative_error(unmasked[1:], references["float32"]["35_tokens_masked"][1:]) > 100 * FP32_TOL
    assert relative_error(unmasked[:1], references["float32"]["35_tokens_masked"][:1]) <= FP32_TOL
    assert relative_error(references["float32"]["edit_offset"], references["float32"]["edit_two_refs"]) > 1e-3


# ---------------------------------------------------------------------------------------------------------------
# In-process checks (no pool)

def test_fp8_weights_stay_fp8_with_norms_in_bf16(files):
    model, _, dtypes = qwen_image.load_model(files["float8_e4m3fn"])
    block = model.transformer_blocks[0]
    assert dtypes.layerwise
    assert block.attn.to_q.weight.dtype == torch.float8_e4m3fn and block.img_mlp.net[2].weight.dtype == \
        torch.float8_e4m3fn
    assert block.attn.norm_q.weight.dtype == torch.bfloat16 and model.proj_out.weight.dtype == torch.bfloat16
    upcast = qwen_image.load_model(files["float8_e4m3fn"], dtype="bfloat16")[0]
    assert upcast.transformer_blocks[0].attn.to_q.weight.dtype == torch.bfloat16
    down = qwen_image.load_model(files["original"], dtype="float8_e5m2")[0]
    assert down.transformer_blocks[0].attn.to_k.weight.dtype == torch.float8_e5m2


def test_loading_reports_progress(files):
    seen = []
    qwen_image.load_model(files["original"], progress=lambda fraction, message: seen.append(fraction))
    assert seen == sorted(seen) and seen[-1] == 1.0 and len(seen) > 3


def test_mismatched_weights_are_named(files, tmp_path):
    from safetensors.torch import load_file, save_file
    state = load_file(files["original"])
    state.pop("transformer_blocks.1.attn.to_k.bias")
    state["transformer_blocks.0.attn.lora_A.weight"] = torch.zeros(2, 2)
    save_file(state, str(tmp_path / "broken.safetensors"))
    with pytest.raises(ValueError, match=r"missing \(e\.g\. \['transformer_blocks\.1\.attn\.to_k\.bias'\]\).*"
                                         r"not part of the model"):
        qwen_image.load_model(str(tmp_path / "broken.safetensors"))


def test_cancel_is_checked_between_blocks(files):
    worker, context = single_rank_worker(files["original"])
    x, t, inputs = make_cases()["odd_latent"]
    worker.forward(x, t, inputs, torch.empty(x.shape), context)
    assert context.cancel_checks == len(worker.model.transformer_blocks)


def test_edit_2511_by_option(files, references):
    """A file that cannot say it is Edit-2511 (no marker) loads as one with variant="edit_2511"."""
    from sp_runtime.contract import LoadRequest
    from sp_runtime.groups import ParallelGroups, SeqParallel
    groups = ParallelGroups(SPConfig(["cpu"]), 0, SeqParallel.single(), None, 0, None)
    detection = qwen_image.detect(read_checkpoint_header(files["original"]))
    request = LoadRequest(files["original"], options={"variant": "edit_2511"})
    worker = qwen_image.load(request, detection, torch.device("cpu"), groups, lambda *_: None)
    assert worker.info.variant == "edit_2511"
    x, t, inputs = make_cases()["edit_two_refs"]
    out = torch.empty(x.shape)
    worker.forward(x, t, inputs, out, LocalContext(groups))
    assert_parity(out, references["edit_2511"]["edit_two_refs"], "float32", "edit_2511/option")
    with pytest.raises(ValueError, match="variant 'edit_2512' is unknown"):
        qwen_image.load_model(files["original"], options={"variant": "edit_2512"})


def test_token_writer_equals_full_unpatchify():
    grid = TokenGrid.of(9, 13, 2)
    latent = torch.randn(2, 16, 9, 13)
    tokens, _ = reference_pack(latent, 2)
    for first, stop in [(0, grid.count), (3, 4), (5, 23), (6, 35), (13, 14), (0, 1)]:
        out = torch.full_like(latent, float("nan"))
        grid.write(out, tokens[:, first:stop], first)
        written = ~out.isnan()
        assert torch.equal(out[written], latent[written])
        rows = {r for t in range(first, stop) for r in (2 * (t // grid.cols), 2 * (t // grid.cols) + 1) if r < 9}
        assert written.any(dim=(0, 1, 3)).nonzero().flatten().tolist() == sorted(rows)


# ---------------------------------------------------------------------------------------------------------------
# ComfyUI's own model (only where COMFYUI_PATH points at a ComfyUI checkout)

def test_comfyui_parity(family_pool, tmp_path):
    from comfy_support import NO_COMFYUI, comfyui_path, import_comfy
    if comfyui_path() is None:
        pytest.skip(NO_COMFYUI)
    import_comfy()
    import comfy.ldm.qwen_image.model as comfy_qwen
    import comfy.ops
    from safetensors.torch import save_file
    model = comfy_qwen.QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=6,
        joint_attention_dim=32, axes_dims_rope=(4, 6, 6), dtype=torch.float32, device="cpu",
        operations=comfy.ops.disable_weight_init)
    randomize_(model, SEED + 1)
    path = str(tmp_path / "comfy_qwen.safetensors")
    save_file({COMFY_PREFIX + key: value.contiguous() for key, value in model.state_dict().items()}, path)
    handle = family_pool.load_model(path)
    for name, (x, t, inputs) in make_cases().items():
        inputs = dict(inputs)
        context, mask = inputs.pop("context"), inputs.pop("attention_mask", None)
        with torch.no_grad():
            expected = model(x, t, context, transformer_options={}, **inputs)
        assert_parity(handle(x, t, context=context, **inputs), expected, "float32", f"comfyui/{name}")
        if mask is None:
            continue
        with torch.no_grad():
            masked = model(x, t, context, attention_mask=mask, transformer_options={}, **inputs)
        if torch.equal(masked, expected):
            continue  # ComfyUI 0.3.64's Qwen-Image ignores attention_mask (it never receives one); newer apply it
        assert_parity(handle(x, t, context=context, attention_mask=mask, **inputs), masked, "float32",
                      f"comfyui/{name}/masked")
