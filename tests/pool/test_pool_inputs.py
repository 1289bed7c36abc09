"""Inputs: bad arguments and bad files are rejected on the host with clear errors; unchanged conditioning is not
copied again (and changed conditioning always is, so results stay right); the arenas grow and shrink safely.
"""
from __future__ import annotations

import os

import pytest
import torch

from sp_runtime.pool import RemoteError
from pool_kit import assert_matches, open_pool, reference, toy_checkpoint, toy_inputs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return toy_checkpoint(tmp_path_factory.mktemp("toy"))


@pytest.fixture(scope="module")
def pool():
    with open_pool(2) as pool:
        yield pool


@pytest.fixture(scope="module")
def model(pool, checkpoint):
    return pool.load_model(checkpoint)


@pytest.fixture(scope="module")
def expected(checkpoint):
    return reference(checkpoint)


def call(model, inputs, **extra):
    return model(inputs["x"], inputs["timestep"], context=inputs["context"], y=inputs["y"], **extra)


@pytest.mark.parametrize("change, message", [
    (lambda i: {"x": i["x"][:, :3]}, "3 channels"),
    (lambda i: {"x": i["x"][0]}, "3-D"),
    (lambda i: {"x": i["x"].to(torch.int64)}, "floating-point"),
    (lambda i: {"x": i["x"].numpy()}, "torch.Tensor"),
    (lambda i: {"context": i["context"][:1]}, "context has shape"),
    (lambda i: {"timestep": torch.rand(3)}, "timestep has shape"),
    (lambda i: {"y": i["y"][:1]}, "y has shape"),
])
def test_bad_arguments_are_rejected_on_the_host(pool, model, change, message):
    calls = pool.stats["calls"]
    inputs = {**toy_inputs(), **change(toy_inputs())}
    with pytest.raises(ValueError, match=message):
        call(model, inputs)
    assert pool.stats["calls"] == calls  # nothing reached the workers


def test_unsendable_and_mis_batched_extras(pool, model):
    inputs = toy_inputs()
    with pytest.raises(ValueError, match="'options' has type function"):
        call(model, inputs, options=lambda: None)
    with pytest.raises(ValueError, match=r"ref_latents\[1\] has shape"):
        call(model, inputs, ref_latents=[torch.zeros(2, 4, 4, 4), torch.zeros(1, 4, 4, 4)])


def test_bad_files_are_rejected_before_the_workers(pool, tmp_path, checkpoint):
    not_a_checkpoint = tmp_path / "notes.safetensors"
    not_a_checkpoint.write_text("hello, this is not a checkpoint at all" * 10)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(open(checkpoint, "rb").read()[:-100])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        pool.load_model(tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="not a safetensors checkpoint"):
        pool.load_model(not_a_checkpoint)
    with pytest.raises(ValueError, match="truncated"):
        pool.load_model(truncated)
    with pytest.raises(ValueError, match="dtype 'int3' is not supported"):
        pool.load_model(checkpoint, dtype="int3")
    assert pool.state == "idle"


def test_worker_side_load_failure_keeps_the_pool(pool, tmp_path, checkpoint):
    # A header that passes detection but whose family config is invalid: every rank fails the same way.
    from safetensors.torch import load_file, save_file
    broken = tmp_path / "broken.safetensors"
    save_file(load_file(checkpoint), str(broken), metadata={"ulysses_sp.family": "toy",
                                                            "ulysses_sp.config": '{"bogus": 1}'})
    pids = pool.worker_pids
    with pytest.raises(RemoteError, match="unknown toy config keys"):
        pool.load_model(broken)
    assert pool.worker_pids == pids and pool.state == "idle"


def test_unchanged_conditioning_is_not_copied_again(pool, model, expected):
    inputs = toy_inputs(seed=1)
    call(model, inputs)
    for step in range(3):
        # like ComfyUI: a new x each step, conditioning rebuilt as new tensors with the same content
        fresh = {**toy_inputs(seed=100 + step), "context": inputs["context"].clone(), "y": inputs["y"].clone(),
                 "timestep": inputs["timestep"]}
        out = call(model, fresh)
        assert pool.stats["last_conditioning_bytes_copied"] == 0
        assert pool.stats["last_copied"] == {"x": fresh["x"].nbytes}
        assert_matches(out, expected(**fresh))


def test_changed_conditioning_is_copied_and_used(pool, model, expected):
    inputs = toy_inputs(seed=2)
    call(model, inputs)
    inputs["context"].mul_(-1.0)  # in place: same object, new content
    out = call(model, inputs)
    assert pool.stats["last_copied"]["context"] == inputs["context"].nbytes
    assert_matches(out, expected(**inputs))
    other = {**inputs, "context": torch.randn_like(inputs["context"])}
    assert_matches(call(model, other), expected(**other))
    assert pool.stats["last_conditioning_bytes_copied"] == other["context"].nbytes


def test_alternating_cond_and_uncond_both_stay_resident(pool, model, expected):
    cond, uncond = toy_inputs(seed=3), toy_inputs(seed=4)
    for inputs in (cond, uncond):
        call(model, inputs)
    for inputs in (cond, uncond, cond, uncond):
        out = call(model, {**inputs, "context": inputs["context"].clone()})
        assert pool.stats["last_conditioning_bytes_copied"] == 0
        assert_matches(out, expected(**inputs))


def test_lists_scalars_and_masks_reach_the_model(pool, model, expected):
    inputs = toy_inputs(seed=5)
    refs = [torch.randn(2, 4, 6, 6), torch.randn(2, 4, 4, 8)]
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False
    extra = {"ref_latents": refs, "guidance": 3.5, "attention_mask": mask}
    out = call(model, inputs, **extra)
    assert_matches(out, expected(**inputs, **extra))
    without = expected(**inputs)
    assert (out - without).abs().max() > 1e-3  # the extras changed the result: they really arrived


def test_arenas_grow_and_results_stay_right(pool, model, expected):
    for seed, size in enumerate([(8, 8), (64, 48), (6, 10), (64, 48)]):
        inputs = toy_inputs(seed=seed, size=size, text=3 + seed)
        assert_matches(call(model, inputs), expected(**inputs))
    assert all(os.path.exists(f"/dev/shm/{name}") for name in pool.segment_names())


def test_bfloat16_latents_come_back_in_bfloat16(pool, model, expected):
    inputs = toy_inputs(seed=6)
    out = call(model, {**inputs, "x": inputs["x"].bfloat16()})
    assert out.dtype == torch.bfloat16
    reference_out = expected(**{**inputs, "x": inputs["x"].bfloat16().float()})
    assert (out.float() - reference_out).abs().max() <= 2e-2 * max(1.0, reference_out.abs().max())


def test_results_of_different_inputs_stay_distinct_after_later_calls(pool, model, expected):
    """Each result is the caller's own tensor: later calls (which reuse the output arena) leave it as it was."""
    cases = [toy_inputs(seed=seed) for seed in (20, 21, 22)]
    outs = [call(model, inputs) for inputs in cases]
    for out, inputs in zip(outs, cases):
        assert_matches(out, expected(**inputs))
    assert (outs[0] - outs[1]).abs().max() > 1e-2


def test_a_model_that_casts_its_inputs_sees_each_call_s_inputs(pool, checkpoint):
    """bf16 compute casts the float32 inputs, so the workers keep cast copies in their device cache (on CPU too):
    every call with new x and new conditioning of the same shapes must use those, not a cached copy of earlier
    ones (more calls than the arena keeps copies of one input, so its slots are recycled)."""
    handle = pool.load_model(checkpoint, "bfloat16")
    expected = reference(checkpoint, "bfloat16")
    try:
        previous = None
        for seed in range(30, 35):
            inputs = toy_inputs(seed=seed)
            out = call(handle, inputs)
            wanted = expected(**inputs)
            scale = max(1.0, wanted.abs().max().item())
            assert (out - wanted).abs().max().item() <= 2e-2 * scale, f"call {seed - 30}"
            if previous is not None:  # the inputs really differ: a stale copy would miss by far more than that
                assert (expected(**previous) - wanted).abs().max().item() > 0.2 * scale
            previous = inputs
    finally:
        pool.unload(handle)


# ---- the input arena on its own (no workers) -------------------------------------------------------------------
def test_arena_reuses_equal_content_and_keeps_versions_when_it_grows():
    from sp_runtime.pool.arena import InputArena
    arena = InputArena("tarena")
    try:
        context = torch.randn(2, 8, 16)
        specs, copied = arena.stage({"x": torch.randn(1, 4), "context": context}, frozenset({"x"}))
        version = {spec["name"]: spec["version"] for spec in specs}["context"]
        first_segment = arena.segment.name
        assert copied == {"x": 16, "context": context.nbytes}
        specs, copied = arena.stage({"x": torch.randn(1, 4), "context": context.clone()}, frozenset({"x"}))
        assert copied == {"x": 16}  # equal content: not copied, same version
        assert {spec["name"]: spec["version"] for spec in specs}["context"] == version
        big = torch.randn(2 ** 19)  # 2 MiB: larger than the first segment, which is replaced
        specs, copied = arena.stage({"x": big, "context": context}, frozenset({"x"}))
        names = {spec["name"]: spec for spec in specs}
        assert arena.segment.name != first_segment and not os.path.exists(f"/dev/shm/{first_segment}")
        assert copied["context"] == context.nbytes and names["context"]["version"] == version  # moved, same content
        view = arena.segment.view(names["context"]["offset"], torch.float32, (2, 8, 16))
        assert torch.equal(view, context) and version in arena.live_versions()
    finally:
        arena.release()
    assert arena.segment is None


def test_arena_copies_in_place_changes_of_the_same_object():
    from sp_runtime.pool.arena import InputArena
    arena = InputArena("tarena2")
    try:
        context = torch.zeros(4, 4)
        arena.stage({"context": context})
        context.add_(1.0)  # same object, bumped _version
        specs, copied = arena.stage({"context": context})
        assert copied == {"context": context.nbytes}
        assert torch.equal(arena.segment.view(specs[0]["offset"], torch.float32, (4, 4)), context)
    finally:
        arena.release()


def test_every_new_content_gets_a_new_version():
    """Workers cache device copies by version: a slot recycled for new content (x every call, the third distinct
    context when two are kept) must carry a version never used before."""
    from sp_runtime.pool.arena import InputArena
    arena = InputArena("tarena3")
    try:
        seen = set()
        for step in range(5):
            specs, _ = arena.stage({"x": torch.randn(2, 4), "context": torch.randn(3, 8)}, frozenset({"x"}))
            versions = {spec["name"]: spec["version"] for spec in specs}
            assert not set(versions.values()) & seen, (step, versions)
            seen |= set(versions.values())
    finally:
        arena.release()
