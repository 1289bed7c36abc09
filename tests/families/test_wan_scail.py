"""Wan 2.1 SCAIL-2 (and SCAIL-Preview) under SP: ComfyUI's reference_latent frames ahead of the video, pose_latents
at half resolution after it, SCAIL-2's mask streams (ref_mask_latents, sam_latents) and both rotary placements
(animation, and replacement mode: ref_mask_flag False) equal a single-device whole-sequence forward over diffusers'
stock blocks (sp_lab.references.wan_tokens) at Ulysses 1-4 (6 heads), Ring 3, Ulysses 2 x Ring 2 and Ulysses 2 x
CFG 2, fp32, padded and odd token counts, batch 2, fewer tokens than ranks; detection from the header; bad inputs and
what SCAIL cannot take are named."""
from __future__ import annotations

import pytest
import torch

from family_support import assert_parity, at_worlds, relative_error, single_rank_worker
from sp_lab.references.wan_tokens import scail_reference_forward
from sp_lab.tiny_models import COMFY_PREFIX, build_tiny_model, write_tiny_checkpoint

pytest_plugins = ["family_pools"]  # the shared per-degree and per-layout worker pools

SEEDS = {"scail2": 23, "scail": 24}


def cases(variant: str) -> dict:
    """(x, timestep, inputs) as ComfyUI's WAN21_SCAIL2 passes them: 18 reference + 27 video + 12 pose tokens
    (heights padded, the pose at half size); replacement mode with one reference; 1 + 1 tokens with batch 1."""
    g = torch.Generator().manual_seed(SEEDS[variant])

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    def call(batch, refs, frames, height, width, masks=True, **extra):
        inputs = {"context": rand(batch, 512, 32), "clip_fea": rand(batch, 5, 1280),
                  "pose_latents": rand(batch, 20, frames, (height + 1) // 2, (width + 1) // 2), **extra}
        if refs:
            inputs["reference_latent"] = rand(batch, 20, refs, height, width)
        if masks and variant == "scail2":
            inputs["ref_mask_latents"] = (rand(batch, 28, refs + frames, height, width) > 0).float()
            inputs["sam_latents"] = (rand(batch, 28, frames, (height + 1) // 2, (width + 1) // 2) > 0).float()
        return rand(batch, 20, frames, height, width), torch.tensor([700.0, 300.0])[:batch], inputs

    return {"animation": call(2, 2, 3, 5, 6), "replacement": call(2, 1, 3, 5, 6, ref_mask_flag=False),
            "2_tokens_batch_1": call(1, 0, 1, 2, 2, masks=False, ref_mask_flag=True)}


@pytest.fixture(scope="session")
def scail_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wan_scail")
    return {variant: write_tiny_checkpoint("wan", str(folder / f"wan2.1_14B_{variant}.safetensors"), seed=seed,
                                           variant=variant, prefix=COMFY_PREFIX) for variant, seed in SEEDS.items()}


@pytest.fixture(scope="session")
def references():
    refs = {}
    for variant, seed in SEEDS.items():
        model = build_tiny_model("wan", seed, variant=variant)
        refs[variant] = {case: scail_reference_forward(model, x, t, **inputs)
                         for case, (x, t, inputs) in cases(variant).items()}
    return refs


def _check(pool, files, references, what, variants=tuple(SEEDS)):
    for variant in variants:
        handle = pool.load_model(files[variant])
        assert handle.info.variant == variant and handle.info.config["pose_in_channels"] == 20
        for case, (x, t, inputs) in cases(variant).items():
            assert_parity(handle(x, t, **inputs), references[variant][case], "float32", f"scail/{what}/{case}")
        handle.unload()


def test_fp32_parity_every_ulysses_degree(family_pool, scail_files, references):
    _check(family_pool, scail_files, references, f"{variant_label(family_pool)}")


def variant_label(pool) -> str:
    return f"degree{pool.config.world_size}"


def test_fp32_parity_ring_hybrid_and_cfg(layout_pool, scail_files, references):
    layout, pool = layout_pool
    _check(pool, scail_files, references, layout, variants=("scail2",))


@pytest.mark.parametrize("tp_pool", ["tp2"], indirect=True)
def test_fp32_parity_tensor_parallel(tp_pool, scail_files, references):
    """Its convs are outside the blocks: TP 2 splits the base Wan's blocks (6 heads: 3 / 3)."""
    layout, pool = tp_pool
    _check(pool, scail_files, references, layout)


def test_the_conditions_change_the_output(references):
    """Guard: without the pose, the masks or replacement mode's placement the reference differs."""
    model = build_tiny_model("wan", SEEDS["scail2"], variant="scail2")
    x, t, inputs = cases("scail2")["animation"]
    want = references["scail2"]["animation"]
    for dropped in ("pose_latents", "ref_mask_latents", "sam_latents"):
        other = {key: value for key, value in inputs.items() if key != dropped}
        assert relative_error(scail_reference_forward(model, x, t, **other), want) > 1e-3, dropped
    flipped = scail_reference_forward(model, x, t, **inputs, ref_mask_flag=False)
    assert relative_error(flipped, want) > 1e-3


def test_bad_inputs_are_named(scail_files):
    worker, context = single_rank_worker(scail_files["scail2"])
    x, t, inputs = cases("scail2")["animation"]
    out = torch.empty(2, 16, 3, 5, 6)
    bad = {**inputs, "ref_mask_latents": inputs["ref_mask_latents"][:, :, 1:]}
    with pytest.raises(ValueError, match=r"ref_mask_latents has shape \[2, 28, 4, 5, 6\]; this Wan SCAIL model takes "
                                         r"\[B, 28, 5, 5, 6\]"):
        worker.forward(x, t, bad, out, context)
    with pytest.raises(ValueError, match="ScaleROPE's rope_options are not applied to Wan scail2 models"):
        worker.forward(x, t, {**inputs, "rope_options": {"scale_x": 2.0}}, out, context)
    with pytest.raises(ValueError, match="time_dim_concat cannot be combined with a Wan SCAIL model"):
        worker.forward(x, t, {**inputs, "time_dim_concat": x}, out, context)
    worker, context = single_rank_worker(scail_files["scail"])
    with pytest.raises(ValueError, match="sam_latents needs SCAIL-2's patch_embedding_mask"):
        worker.forward(x, t, {key: value for key, value in inputs.items() if key != "ref_mask_latents"}, out, context)


@at_worlds(2)
def test_quantized_file_equals_its_dequantized_weights(family_pool, tmp_path):
    """SCAIL-2 from a ComfyUI mixed-precision file (the template's int8 convrot among its formats; the pose and mask
    convs stay float as in the release) at weight dtype fp32 equals the run on its dequantized weights."""
    from sp_lab.tiny_models.quant_files import write_quantized
    from sp_runtime.families.wan import load_model
    path, reference = str(tmp_path / "scail2_quant.safetensors"), str(tmp_path / "scail2_dequantized.safetensors")
    kinds = write_quantized("wan", path, reference, "comfy_quant", 3, COMFY_PREFIX, {"ulysses_sp.head_dim": "16"},
                            variant="scail2")
    assert "int8_tensorwise convrot" in set(kinds.values()), set(kinds.values())
    handle = family_pool.load_model(path, "fp32")
    assert handle.info.variant == "scail2" and handle.info.quant
    model = load_model(reference, "float32")[0]
    for case in ("animation", "replacement"):
        x, t, inputs = cases("scail2")[case]
        assert_parity(handle(x, t, **inputs), scail_reference_forward(model, x, t, **inputs), "float32",
                      f"scail/quantized/{case}")
    handle.unload()
