"""Flux beyond the conformance suite (tests/families/test_family_conformance.py runs every degree, layout and file
layout on sp_lab.conformance.cases.flux_cases: odd token counts, 6 heads, batch 2, Kontext references): schnell and
Fill, no guidance, bf16 / fp8 storage within their rounding; our key conversion equals diffusers' converter at full
size; ComfyUI's own model where present; CFG-parallel batch split for both image families."""
from __future__ import annotations

import copy

import pytest
import torch

from family_support import FP32_TOL, assert_parity, merge_rank_outputs, relative_error, run_family_cases
from sp_lab.references.flux import reference_forward as flux_reference
from sp_lab.references.qwen_image import reference_forward as qwen_image_reference
from sp_runtime.families import flux
from sp_runtime.local_ranks import run_distributed
from sp_lab.conformance.cases import flux_cases as make_cases
from sp_lab.tiny_models import COMFY_PREFIX, build_tiny_model, randomize_, write_tiny_checkpoint

pytest_plugins = ["family_pools"]  # the shared per-degree worker pools
SEED = 5  # the conformance suite's tiny Flux (sp_lab.conformance.product)
VARIANTS = {"original": dict(), "schnell": dict(variant="schnell"), "fill": dict(variant="fill")}
LOW_PRECISION = ("bfloat16", "float8_e4m3fn")


@pytest.fixture(scope="session")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flux")
    paths = {name: write_tiny_checkpoint("flux", str(folder / name), seed=SEED, **kw)
             for name, kw in VARIANTS.items()}
    for dtype in LOW_PRECISION:
        paths[dtype] = write_tiny_checkpoint("flux", str(folder / f"{dtype}.safetensors"), dtype=dtype, seed=SEED,
                                             prefix=COMFY_PREFIX)
    return paths


@pytest.fixture(scope="session")
def references(files, family_subject):
    """Stock diffusers outputs: fp32 from in-memory models (independent of our loader and key conversion; dev: the
    conformance suite's, the same weights); low precision from the same file loaded in-process with the same dtype
    policy."""
    def run(model, cases):
        return {name: flux_reference(model, *case[:2], **case[2]) for name, case in cases.items()}
    refs = {"float32": family_subject("flux").outputs,
            "schnell": run(build_tiny_model("flux", SEED, guidance_embeds=False), _variant_cases("schnell")),
            "fill": run(build_tiny_model("flux", SEED, in_channels=384, out_channels=64), _variant_cases("fill"))}
    for dtype in LOW_PRECISION:
        refs[dtype] = run(flux.load_model(files[dtype])[0], _low_precision_cases())
    return refs


def _variant_cases(variant: str) -> dict:
    cases = make_cases(channels=96 if variant == "fill" else 16)
    return {name: cases[name] for name in ("35_tokens", "batch_1_no_y")}


def _low_precision_cases() -> dict:
    # bf16-exact timesteps: diffusers rounds sigma to the compute dtype, ComfyUI (and we) keep it in float32
    cases = make_cases(timesteps=(0.5, 0.25))
    x, t, inputs = cases["odd_latent"]
    bf16_inputs = {key: value.to(torch.bfloat16) for key, value in inputs.items()}
    return {"35_tokens": cases["35_tokens"], "kontext_offset": cases["kontext_offset"],
            "bf16_latent": (x.to(torch.bfloat16), t, bf16_inputs)}


def test_schnell_and_fill(family_pool, files, references):
    for variant in ("schnell", "fill"):
        handle = family_pool.load_model(files[variant])
        assert handle.info.variant == variant
        for name, (x, t, inputs) in _variant_cases(variant).items():
            assert_parity(handle(x, t, **inputs), references[variant][name], "float32", f"{variant}/{name}")


def test_low_precision_storage(family_pool, files, references):
    for dtype in LOW_PRECISION:
        handle = family_pool.load_model(files[dtype])
        assert (handle.info.weight_dtype, handle.info.compute_dtype) == (dtype, "bfloat16")
        for name, (x, t, inputs) in _low_precision_cases().items():
            assert_parity(handle(x, t, **inputs), references[dtype][name], dtype, f"{dtype}/{name}")


def test_without_guidance_the_term_is_left_out(family_pool, files):
    """ComfyUI adds no guidance embedding when guidance is None; diffusers cannot, so the reference zeroes it."""
    model = build_tiny_model("flux", SEED)
    silent = copy.deepcopy(model)
    silent.time_text_embed.guidance_embedder.linear_2.weight.zero_()
    silent.time_text_embed.guidance_embedder.linear_2.bias.zero_()
    x, t, inputs = make_cases()["odd_latent"]
    inputs = {**inputs, "guidance": None}
    expected = flux_reference(silent, x, t, **{**inputs, "guidance": torch.tensor([1.0, 1.0])})
    handle = family_pool.load_model(files["original"])
    assert (handle.info.family, handle.info.variant, handle.info.in_channels) == ("flux", "dev", 16)
    assert_parity(handle(x, t, **inputs), expected, "float32", "no guidance")


def test_the_references_and_guidance_matter(references):
    """Guards against a test that cannot fail: the cases really exercise reference latents and their methods."""
    fp32 = references["float32"]
    assert relative_error(fp32["kontext_index"], fp32["kontext_uxo"]) > 1e-3
    model = build_tiny_model("flux", SEED)
    x, t, inputs = make_cases()["kontext_offset"]
    no_refs = flux_reference(model, x, t, **{k: v for k, v in inputs.items() if k != "ref_latents"})
    assert relative_error(no_refs, fp32["kontext_offset"]) > 100 * FP32_TOL


# ---------------------------------------------------------------------------------------------------------------
# Key conversion against diffusers' own converter

def _full_size_original(double: int = 2, single: int = 2) -> dict[str, torch.Tensor]:
    """Original-layout Flux.1-dev tensors at full width (3072) with one column: the converters only move rows.

    Each row holds a unique number, so equal outputs mean every row went to the same place.
    """
    hidden, head, mlp = 3072, 128, 4 * 3072
    rows = {"img_in": hidden, "txt_in": hidden, "time_in.in_layer": hidden, "time_in.out_layer": hidden,
            "vector_in.in_layer": hidden, "vector_in.out_layer": hidden, "guidance_in.in_layer": hidden,
            "guidance_in.out_layer": hidden, "final_layer.linear": 64, "final_layer.adaLN_modulation.1": 2 * hidden}
    for i in range(double):
        for stream in ("img", "txt"):
            rows.update({f"double_blocks.{i}.{stream}_mod.lin": 6 * hidden, f"double_blocks.{i}.{stream}_attn.qkv":
                         3 * hidden, f"double_blocks.{i}.{stream}_attn.proj": hidden,
                         f"double_blocks.{i}.{stream}_mlp.0": mlp, f"double_blocks.{i}.{stream}_mlp.2": hidden})
    for i in range(single):
        rows.update({f"single_blocks.{i}.modulation.lin": 3 * hidden, f"single_blocks.{i}.linear1": 3 * hidden + mlp,
                     f"single_blocks.{i}.linear2": hidden})
    state, start = {}, 0
    for module, count in rows.items():
        for kind in ("weight", "bias"):
            state[f"{module}.{kind}"] = torch.arange(start, start + count, dtype=torch.float64)[:, None]
            start += count
    norms = [f"double_blocks.{i}.{s}_attn.norm.{n}_norm.scale" for i in range(double) for s in ("img", "txt")
             for n in ("query", "key")] + [f"single_blocks.{i}.norm.{n}_norm.scale" for i in range(single)
                                           for n in ("query", "key")]
    for key in norms:
        state[key] = torch.arange(start, start + head, dtype=torch.float64)
        start += head
    return state


def test_key_plan_equals_diffusers_converter_at_full_size():
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers
    original = _full_size_original()
    expected = convert_flux_transformer_checkpoint_to_diffusers(
        {COMFY_PREFIX + key: value for key, value in original.items()})
    plan = flux.flux_key_plan(original, hidden=3072)
    assert set(plan) == set(original), "every original key has a destination"
    ours = {target: (transform(original[source]) if transform else original[source])
            for source, targets in plan.items() for target, transform in targets}
    assert set(ours) == set(expected)
    for key, value in expected.items():
        assert torch.equal(ours[key], value), key


# ---------------------------------------------------------------------------------------------------------------
# CFG-parallel (both image families; one spawn)

def test_cfg_parallel_splits_the_batch(files, references, tmp_path):
    """u1 x cfg2: each CFG rank computes one half of the batch and writes only it."""
    qwen_path = write_tiny_checkpoint("qwen_image", str(tmp_path / "qwen.safetensors"), seed=SEED)
    cases = make_cases()
    x, t, inputs = cases["35_tokens"]
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, 3:] = 0
    qwen_case = (x[:, :, None], t, {"context": inputs["context"], "attention_mask": mask,
                                    "ref_latents": [r[:, :, None] for r in cases["kontext_offset"][2]["ref_latents"]]})
    loads = [(files["original"], "default", [cases["kontext_offset"]]), (qwen_path, "default", [qwen_case])]
    results = run_distributed(run_family_cases, 2, {"cfg_degree": 2}, loads, timeout=240)
    merged = [merge_rank_outputs([rank[load][0] for rank in results]) for load in range(2)]
    assert_parity(merged[0], references["float32"]["kontext_offset"], "float32", "cfg2/flux")
    expected = qwen_image_reference(build_tiny_model("qwen_image", SEED), qwen_case[0], t, **qwen_case[2])
    assert_parity(merged[1], expected, "float32", "cfg2/qwen")


# ---------------------------------------------------------------------------------------------------------------
# ComfyUI's own model (only where COMFYUI_PATH points at a ComfyUI checkout)

def test_comfyui_parity(family_pool, tmp_path):
    from comfy_support import NO_COMFYUI, comfyui_path, import_comfy
    if comfyui_path() is None:
        pytest.skip(NO_COMFYUI)
    import_comfy()
    import comfy.ldm.flux.model as comfy_flux
    import comfy.ops
    from safetensors.torch import save_file
    model = comfy_flux.Flux(in_channels=16, out_channels=16, vec_in_dim=24, context_in_dim=32, hidden_size=96,
                            mlp_ratio=4.0, num_heads=6, depth=2, depth_single_blocks=2, axes_dim=[4, 6, 6],
                            theta=10000, patch_size=2, qkv_bias=True, guidance_embed=True, dtype=torch.float32,
                            device="cpu", operations=comfy.ops.disable_weight_init)
    randomize_(model, SEED + 1)
    path = str(tmp_path / "comfy_flux.safetensors")
    save_file({COMFY_PREFIX + key: value.contiguous() for key, value in model.state_dict().items()}, path)
    handle = family_pool.load_model(path)
    for name, (x, t, inputs) in make_cases().items():
        with torch.no_grad():
            expected = model(x, t, transformer_options={}, **inputs)
        assert_parity(handle(x, t, **inputs), expected, "float32", f"comfyui/{name}")
