"""Wan VACE under Ulysses SP: the pool's output with ComfyUI's vace_context / vace_strength equals diffusers' own
WanVACETransformer3DModel forward on one process, at degrees 1-4 (3 heads), odd and padded token counts, batch 2,
from ComfyUI-layout files and diffusers folders; several hint videos; and bad VACE inputs are named."""
from __future__ import annotations

import pytest
import torch

from family_support import LocalContext, assert_parity, relative_error
from sp_runtime.config import SPConfig
from sp_lab.references.wan import reference_forward
from sp_runtime.contract import LoadRequest
from sp_runtime.pool.loading import load_worker_model
from sp_runtime.groups import ParallelGroups, SeqParallel
from sp_lab.tiny_models import COMFY_PREFIX, build_tiny_model, write_tiny_checkpoint
from sp_lab.tiny_models.wan import original_state_dict

pytest_plugins = ["family_pools"]  # the shared per-degree worker pools

SEED = 5
SIZE = dict(num_attention_heads=3, attention_head_dim=32)  # 3 heads: 2 and 4 ranks do not divide them
FILES = {"comfy_prefix": dict(prefix=COMFY_PREFIX), "diffusers_folder": dict(layout="diffusers_folder")}


def make_cases(seed: int = 1) -> dict:
    """(x, timestep, kwargs) as ComfyUI's WAN21_Vace passes them. Tokens: 45 (odd), 40 (H and W padded), 1."""
    g = torch.Generator().manual_seed(seed)

    def call(batch, frames, height, width, strength=0.8):
        return (torch.randn(batch, 16, frames, height, width, generator=g), torch.tensor([700.0, 300.0])[:batch],
                {"context": torch.randn(batch, 7, 32, generator=g),
                 "vace_context": torch.randn(batch, 1, 96, frames, height, width, generator=g),
                 "vace_strength": [strength]})

    return {"45_tokens": call(2, 5, 6, 6), "40_tokens_padded": call(2, 2, 7, 9, strength=1.0),
            "1_token_batch_1": call(1, 1, 2, 2)}


def two_hint_cases() -> dict:
    """Two hint videos, each checkable against diffusers' single one: another video first at strength 0, and one
    video given twice (hint videos never see each other, so its hints add up: diffusers with the summed strength)."""
    x, t, inputs = make_cases(seed=2)["45_tokens"]
    hint, other = inputs["vace_context"], torch.randn_like(inputs["vace_context"])
    return {"ignored_first": ((x, t, {**inputs, "vace_context": torch.cat([other, hint], 1),
                                      "vace_strength": [0.0, 0.8]}), (hint, [0.8])),
            "same_twice": ((x, t, {**inputs, "vace_context": torch.cat([hint, hint], 1),
                                   "vace_strength": [0.5, 0.7]}), (hint, [1.2]))}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wan_vace")
    return {name: write_tiny_checkpoint("wan", str(folder / (name + ("" if "folder" in name else ".safetensors"))),
                                        seed=SEED, variant="vace", **arguments, **SIZE)
            for name, arguments in FILES.items()}


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("wan", SEED, variant="vace", **SIZE)


@pytest.fixture(scope="module")
def references(model):
    """diffusers' stock forward on in-memory weights (independent of our loader, key plan and SP forward)."""
    refs = {name: reference_forward(model, x, t, **inputs) for name, (x, t, inputs) in make_cases().items()}
    for name, ((x, t, inputs), (hint, strength)) in two_hint_cases().items():
        refs[name] = reference_forward(model, x, t, inputs["context"], vace_context=hint, vace_strength=strength)
    return refs


def test_fp32_parity(family_pool, files, references):
    for layout, path in files.items():
        handle = family_pool.load_model(path)
        assert (handle.info.variant, handle.info.config["vace_layers"], handle.info.config["num_heads"]) == \
            ("vace", [0, 2], 3)
        cases = {**make_cases(), **{name: case for name, (case, _) in two_hint_cases().items()}}
        if layout != "comfy_prefix":  # the other layouts check loading: one case is enough
            cases = {"45_tokens": cases["45_tokens"]}
        for name, (x, t, inputs) in cases.items():
            assert_parity(handle(x, t, **inputs), references[name], "float32", f"vace/{layout}/{name}")


def test_the_cases_exercise_what_they_claim(model, references):
    """The hint, its strength and the second hint video each change the output."""
    x, t, inputs = make_cases()["45_tokens"]
    without = reference_forward(model, x, t, inputs["context"], vace_context=inputs["vace_context"],
                                    vace_strength=[0.0])
    assert relative_error(without, references["45_tokens"]) > 1e-3
    (x, t, inputs), _ = two_hint_cases()["same_twice"]
    once = reference_forward(model, x, t, inputs["context"], vace_context=inputs["vace_context"][:, :1],
                                 vace_strength=[0.5])
    assert relative_error(once, references["same_twice"]) > 1e-3


def test_key_plan_equals_diffusers_converter():
    """Our per-tensor plan gives what diffusers' converter gives on every key of a full-size VACE 1.3B (meta
    tensors, 15 VACE blocks every 2nd of 30 blocks) and on the tiny model's tensors."""
    from accelerate import init_empty_weights
    from diffusers import WanVACETransformer3DModel
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
    from sp_runtime.families.wan.keys import wan_key_plan
    from sp_runtime.families.wan.vace import architecture as vace_architecture
    with init_empty_weights():
        full = WanVACETransformer3DModel(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30,
                                         vace_layers=list(range(0, 30, 2)))
    for model in (full, build_tiny_model("wan", SEED, variant="vace", **SIZE)):
        original = original_state_dict(model)
        expected = convert_wan_transformer_to_diffusers({COMFY_PREFIX + k: v for k, v in original.items()})
        plan = wan_key_plan(original)
        assert set(plan) == set(original)
        ours = {target: original[source] for source, targets in plan.items() for target, _ in targets}
        assert ours.keys() == expected.keys() == model.state_dict().keys()
        shapes = {key: (None, tuple(value.shape)) for key, value in original.items()}  # header entries
        assert vace_architecture(shapes, "original", {"num_layers": model.config.num_layers}) == {
            "vace_layers": list(model.config.vace_layers), "vace_in_channels": 96}


def test_bad_vace_inputs_are_named(files):
    groups = ParallelGroups(SPConfig(["cpu"]), 0, SeqParallel.single(), None, 0, None)
    worker = load_worker_model(LoadRequest(files["comfy_prefix"]), torch.device("cpu"), groups, lambda *_: None)
    x, t, inputs = make_cases()["45_tokens"]
    out = torch.empty(x.shape)
    bad = {"vace_context": None, "vace_strength": None}
    with pytest.raises(ValueError, match=r"needs vace_context \[B, n, 96, 5, 6, 6\]"):
        worker.forward(x, t, {**inputs, **bad}, out, LocalContext(groups))
    with pytest.raises(ValueError, match=r"vace_context has shape \[2, 1, 96, 5, 4, 6\]"):
        worker.forward(x, t, {**inputs, "vace_context": inputs["vace_context"][..., :4, :]}, out,
                       LocalContext(groups))
    with pytest.raises(ValueError, match="vace_strength has 2 entries for 1 hint videos"):
        worker.forward(x, t, {**inputs, "vace_strength": [1.0, 1.0]}, out, LocalContext(groups))
    with pytest.raises(ValueError, match="not per-frame timesteps"):
        worker.forward(x, torch.full((2, 5), 500.0), inputs, out, LocalContext(groups))
