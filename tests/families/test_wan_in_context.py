"""Wan 2.2 Bernini-R's in-context references under SP: ComfyUI's context_latents (BerniniConditioning's source video
and reference images, each at its own size) as more tokens of a plain Wan 2.2 T2V after the video's,
their rotary turned by the source id, equal a single-device whole-sequence forward over diffusers' stock blocks
(sp_lab.references.wan_tokens) at Ulysses 1-4 (6 heads), Ring 3, Ulysses 2 x Ring 2, Ulysses 2 x CFG 2, TP 2, fp32,
token ranges that split parts, batch 2, fewer tokens than ranks; bad latents, and context_latents on a Wan variant
that does not take them, are named."""
from __future__ import annotations

import pytest
import torch

from family_support import assert_parity, relative_error, single_rank_worker
from sp_lab.references.wan_tokens import in_context_reference_forward
from sp_lab.tiny_models import COMFY_PREFIX, build_tiny_model, write_tiny_checkpoint

pytest_plugins = ["family_pools"]  # the shared per-degree and per-layout worker pools

SEED = 21


def cases() -> dict:
    """(x, timestep, inputs): 27 video + 27 source-video + 6 reference-image tokens (odd heights padded); 1 + 1 tokens
    with batch 1; a plain call."""
    g = torch.Generator().manual_seed(SEED)

    def rand(*shape):
        return torch.randn(*shape, generator=g)
    return {"source_and_reference": (rand(2, 16, 3, 5, 6), torch.tensor([700.0, 300.0]),
                                     {"context": rand(2, 7, 32),
                                      "context_latents": [rand(2, 16, 3, 5, 6), rand(2, 16, 1, 4, 6)]}),
            "2_tokens_batch_1": (rand(1, 16, 1, 2, 2), torch.tensor([500.0]),
                                 {"context": rand(1, 5, 32), "context_latents": [rand(1, 16, 1, 2, 2)]}),
            "plain": (rand(2, 16, 2, 4, 4), torch.tensor([900.0, 100.0]), {"context": rand(2, 6, 32)})}


@pytest.fixture(scope="session")
def bernini_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("wan_in_context") / "wan2.2_bernini_r_high_noise.safetensors"
    return write_tiny_checkpoint("wan", str(path), seed=SEED, variant="t2v", prefix=COMFY_PREFIX)


@pytest.fixture(scope="session")
def references():
    model = build_tiny_model("wan", SEED, variant="t2v")
    return {case: in_context_reference_forward(model, x, t, **inputs) for case, (x, t, inputs) in cases().items()}


def _check(pool, path, references, what):
    handle = pool.load_model(path)
    assert handle.info.variant == "t2v"
    for case, (x, t, inputs) in cases().items():
        assert_parity(handle(x, t, **inputs), references[case], "float32", f"in_context/{what}/{case}")
    handle.unload()


def test_fp32_parity_every_ulysses_degree(family_pool, bernini_file, references):
    _check(family_pool, bernini_file, references, f"degree{family_pool.config.world_size}")


def test_fp32_parity_ring_hybrid_and_cfg(layout_pool, bernini_file, references):
    layout, pool = layout_pool
    _check(pool, bernini_file, references, layout)


def test_tensor_parallel_takes_the_latents(bernini_file, references):
    """The in-context variant leaves the blocks as plain Wan's: a Bernini-R (T2V) model keeps Wan's TP plan."""
    from sp_runtime.config import SPConfig
    from sp_runtime.pool import WorkerPool
    with WorkerPool(SPConfig(["cpu"] * 2, tensor_parallel_degree=2)) as pool:
        _check(pool, bernini_file, references, "tp2")


def test_the_latents_and_their_source_ids_change_the_output(references):
    """Guard: without the latents, or with their rotary not turned, the reference differs."""
    import sp_lab.references.wan_tokens as tokens
    model = build_tiny_model("wan", SEED, variant="t2v")
    x, t, inputs = cases()["source_and_reference"]
    plain = in_context_reference_forward(model, x, t, inputs["context"])
    assert relative_error(plain, references["source_and_reference"]) > 1e-3
    turned, tokens._turned = tokens._turned, lambda rotary, turns: rotary
    try:
        unturned = in_context_reference_forward(model, x, t, **inputs)
    finally:
        tokens._turned = turned
    assert relative_error(unturned, references["source_and_reference"]) > 1e-3


def test_bad_latents_and_other_variants_are_named(bernini_file, tmp_path):
    worker, context = single_rank_worker(bernini_file)
    x, t, inputs = cases()["source_and_reference"]
    bad = {**inputs, "context_latents": [inputs["context_latents"][0][:, :4]]}
    with pytest.raises(ValueError, match=r"context_latents\[0\] has shape \[2, 4, 3, 5, 6\]; this Wan takes latents "
                                         r"\[B or 1, 16, T, H, W\]"):
        worker.forward(x, t, bad, torch.empty(2, 16, 3, 5, 6), context)
    path = write_tiny_checkpoint("wan", str(tmp_path / "i2v_concat.safetensors"), seed=1, variant="i2v_concat",
                                 prefix=COMFY_PREFIX)
    worker, context = single_rank_worker(path)
    x36 = torch.cat([x, x, x[:, :4]], dim=1)
    with pytest.raises(ValueError, match="context_latents belongs to a Wan variant the sequence-parallel Wan does not"):
        worker.forward(x36, t, inputs, torch.empty(2, 16, 3, 5, 6), context)
