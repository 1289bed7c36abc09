"""ComfyUI weight patches in sp_runtime's neutral form, without ComfyUI: a PatchSet survives its trip (JSON + shared
memory) unchanged with the same digest, any change of content changes the digest; the workers' math
(sp_runtime.lora.patch_math) equals plain matrix formulas (tests/patch_reference.py) for every kind, with DoRA,
offsets into a fused weight, strength_model and stacking; a patch that does not fit is a clear error. When
COMFYUI_PATH is set, the same patches also equal ComfyUI's own calculate_weight.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

import comfy_support as cs
from patch_reference import random_patch, reference
from sp_runtime.lora.patch_math import patched_weight
from sp_runtime.lora.patch_set import KINDS, PatchSet, TargetPatches, WeightPatch
from sp_runtime.pool.patch_transport import KeptSets, read_patch_set, stage_patch_set
from sp_runtime.pool.segments import our_segments

SHAPE = (16, 12)


def sample_set(strength: float = 0.5) -> PatchSet:
    qkv = TargetPatches((48, 12), (random_patch("lora", (16, 12), 1, strength=strength, alpha=2.0,
                                                offset=(0, 16, 16)),
                                   random_patch("diff", (48, 12), 2, strength=-0.7)))
    mlp = TargetPatches(SHAPE, (random_patch("loha", SHAPE, 3, strength=1.0, alpha=1.0, strength_model=0.9),))
    return PatchSet({"double_blocks.0.img_attn.qkv.weight": qkv, "double_blocks.0.img_mlp.0.weight": mlp},
                    (("lora/diff on 1 weights", strength), ("loha on 1 weights", 1.0)))


def assert_same_set(actual: PatchSet, expected: PatchSet) -> None:
    assert actual.labels == expected.labels and list(actual.targets) == list(expected.targets)
    for key, target in expected.targets.items():
        got = actual.targets[key]
        assert got.shape == target.shape and len(got.patches) == len(target.patches)
        for mine, theirs in zip(got.patches, target.patches):
            assert mine.scalars() == theirs.scalars()
            assert mine.tensors.keys() == theirs.tensors.keys()
            for name, tensor in theirs.tensors.items():
                assert mine.tensors[name].dtype == tensor.dtype and torch.equal(mine.tensors[name], tensor)


def test_description_round_trips_through_json_and_keeps_its_digest():
    patches = sample_set()
    description, tensors = patches.to_message()
    copy = PatchSet.from_message(json.loads(json.dumps(description)), tensors.__getitem__)
    assert_same_set(copy, patches)
    assert copy.digest == patches.digest
    assert sample_set(strength=0.25).digest != patches.digest  # a strength is content
    changed = sample_set()
    changed.targets["double_blocks.0.img_mlp.0.weight"].patches[0].tensors["w1a"][0, 0] += 1e-3
    assert changed.digest != sample_set().digest  # so is every tensor byte


def test_transport_over_shared_memory_copies_the_set_and_leaves_no_segment():
    patches = sample_set()
    patches.targets["double_blocks.0.img_mlp.0.weight"].patches[0].tensors["w2b"] = torch.randn(2, 12).bfloat16()
    before = set(our_segments(os.getpid()))
    entry, segment = stage_patch_set(patches, "testpatch")
    try:
        json.dumps(entry)  # the request travels as JSON
        received = read_patch_set(entry)
    finally:
        segment.release()
    assert_same_set(received, patches)
    assert set(our_segments(os.getpid())) == before
    kept = KeptSets()
    for digest in "abcde":
        kept.use(digest)
    assert "a" not in kept and "e" in kept  # the oldest set goes first


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("strength", [1.0, 0.5, -0.7])
def test_each_kind_equals_the_reference(kind, strength):
    weight = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    patch = random_patch(kind, SHAPE, 7, strength=strength, alpha=1.5 if kind != "set" else None)
    expected = reference(weight, [patch])
    actual = patched_weight(weight.clone(), [patch], "w")
    assert (actual - expected).abs().max() <= 1e-5 * max(1.0, expected.abs().max().item())
    if kind != "set":
        assert (actual - weight).abs().max() > 1e-3  # the patch matters


@pytest.mark.parametrize("kind", ["lora", "loha", "lokr", "glora", "oft"])
def test_dora_offsets_strength_model_and_stacks_equal_the_reference(kind):
    weight = torch.randn(48, 12, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    dora = {} if kind == "oft" else {"dora_scale": 1.0 + 0.1 * torch.randn(16, 1, generator=g)}
    first = random_patch(kind, (16, 12), 3, strength=0.8, alpha=2.0, offset=(0, 16, 16))
    first = WeightPatch(first.kind, {**first.tensors, **dora}, first.strength, first.alpha, 1.0, first.offset)
    stack = [first, random_patch("lora", (48, 12), 4, strength=-0.7, strength_model=0.95),
             random_patch("diff", (16, 12), 5, strength=0.5, offset=(0, 32, 16))]
    expected = reference(weight, stack)
    actual = patched_weight(weight.clone(), stack, "qkv")
    assert (actual - expected).abs().max() <= 1e-5 * max(1.0, expected.abs().max().item())


def test_a_lokr_with_both_factors_full_scales_by_alpha_over_w2_rows_per_w1_row():
    """ComfyUI's newest lokr.py (839df9f2): full w1 [2, 3] and w2 [8, 4] scale by alpha / (8 // 2); 0.3.64 used 1."""
    g = torch.Generator().manual_seed(6)
    w1, w2, weight = torch.randn(2, 3, generator=g), torch.randn(8, 4, generator=g), torch.randn(16, 12, generator=g)
    # the Kronecker product written out: block (i, j) is w1[i, j] x w2
    kron = torch.cat([torch.cat([w1[i, j] * w2 for j in range(3)], 1) for i in range(2)], 0)
    for alpha, scale in ((3.0, 3.0 / 4), (None, 1.0)):
        patch = WeightPatch("lokr", {"w1": w1, "w2": w2}, strength=0.5, alpha=alpha)
        expected = weight + 0.5 * scale * kron
        actual = patched_weight(weight.clone(), [patch], "w")
        assert (actual - expected).abs().max() <= 1e-5 * max(1.0, expected.abs().max().item()), alpha
    tall_w1 = WeightPatch("lokr", {"w1": torch.ones(4, 3), "w2": torch.ones(2, 4)}, alpha=1.0)
    with pytest.raises(ValueError, match=r"lokr patch on w .*w2 rows 2 < w1 rows 4: alpha / \(w2 rows // w1 rows\) "
                                         r"divides by zero"):
        patched_weight(torch.zeros(8, 12), [tall_w1], "w")


def test_a_patch_that_does_not_fit_is_a_clear_error():
    patch = random_patch("lora", (16, 10), 1)
    with pytest.raises(ValueError, match=r"lora patch on blocks.0.w \(shape \[16, 12\]\) does not fit"):
        patched_weight(torch.zeros(SHAPE), [patch], "blocks.0.w")
    with pytest.raises(ValueError, match="'tucker' is not supported"):
        WeightPatch("tucker", {})
    with pytest.raises(ValueError, match="missing tensors"):
        WeightPatch("lora", {"up": torch.zeros(2, 2)})


@pytest.mark.skipif(cs.comfyui_path() is None, reason=cs.NO_COMFYUI)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_equals_comfys_own_calculate_weight(kind):
    """The same patch through nodes/weight_patches.translate and ComfyUI's adapters: equal weights."""
    cs.import_comfy()
    import comfy.lora
    import comfy.weight_adapter as adapters
    translate = cs.import_node_module("weight_patches").translate
    patch = random_patch(kind, SHAPE, 11, strength=-0.7, alpha=1.5 if kind != "set" else None)
    if kind in ("diff", "set"):
        value = (kind, (patch.tensors["diff" if kind == "diff" else "value"],))
    else:
        cls = next(cls for cls in adapters.adapters if cls.name == kind)
        fields = cs.import_node_module("weight_patches").ADAPTER_FIELDS[kind]
        value = cls(set(), tuple(patch.alpha if name == "alpha" else patch.tensors.get(name) for name in fields))
    comfy_patches = {"diffusion_model.w.weight": [(patch.strength, value, 1.0, None, None)]}
    ours = translate(comfy_patches, {"w.weight": SHAPE}).targets["w.weight"].patches
    weight = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))
    expected = comfy.lora.calculate_weight(comfy_patches["diffusion_model.w.weight"], weight.clone(), "w.weight")
    actual = patched_weight(weight.clone(), ours, "w.weight")
    assert (actual - expected).abs().max() <= 1e-5 * max(1.0, expected.abs().max().item())
