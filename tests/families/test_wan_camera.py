"""Wan Fun Camera under Ulysses SP: ComfyUI's camera_conditions through control_adapter (Wan 2.1 with CLIP and 32
channels; Wan 2.2 style, 36 channels and no CLIP) equals a single-process diffusers forward with the adapter's output
added to the patch embedding, at degrees 1-4 (6 heads), token ranges that split frames, batch 2; bad conditions are
named; Wan 2.2 Fun 5B Control-Camera files (48-channel latents, which no ComfyUI model class takes) are refused by
name."""
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

pytest_plugins = ["family_pools"]  # the shared per-degree worker pools

# variant -> (seed, input channels, CLIP tokens, text tokens)
MODELS = {"camera": (11, 32, 5, 512), "camera_2.2": (12, 36, 0, 7)}


def make_cases(variant: str) -> dict:
    """(x, timestep, kwargs) as ComfyUI's WAN21_Camera passes them: 45 tokens (5 frames of 9: every degree > 1 splits
    a frame), 24 tokens (3 frames of 8), 1 token with batch 1, and no conditions at all."""
    seed, channels, clip_tokens, text_tokens = MODELS[variant]
    g = torch.Generator().manual_seed(seed)

    def call(batch, frames, height, width, camera=True):
        inputs = {"context": torch.randn(batch, text_tokens, 32, generator=g)}
        if clip_tokens:
            inputs["clip_fea"] = torch.randn(batch, clip_tokens, 1280, generator=g)
        if camera:
            inputs["camera_conditions"] = torch.randn(batch, 24, frames, 8 * height, 8 * width, generator=g)
        return torch.randn(batch, channels, frames, height, width, generator=g), torch.tensor([700.0, 300.0])[:batch], \
            inputs

    return {"45_tokens": call(2, 5, 6, 6), "1_token_batch_1": call(1, 1, 2, 2),
            "24_tokens": call(2, 3, 4, 8), "no_conditions": call(2, 2, 4, 4, camera=False)}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wan_camera")
    return {variant: write_tiny_checkpoint("wan", str(folder / f"{variant}.safetensors"), seed=seed, variant=variant,
                                           prefix=COMFY_PREFIX)
            for variant, (seed, *_rest) in MODELS.items()}


@pytest.fixture(scope="module")
def references():
    """diffusers' stock forward on in-memory weights (independent of our loader and SP forward)."""
    refs = {}
    for variant, (seed, *_rest) in MODELS.items():
        model = build_tiny_model("wan", seed, variant=variant)
        refs[variant] = {}
        for case, (x, t, inputs) in make_cases(variant).items():
            refs[variant][case] = reference_forward(model, x, t, **inputs)
    return refs


def test_fp32_parity(family_pool, files, references):
    for variant, path in files.items():
        handle = family_pool.load_model(path)
        assert (handle.info.variant, handle.info.config["camera_in_channels"]) == (variant, 24)
        for case, (x, t, inputs) in make_cases(variant).items():
            assert_parity(handle(x, t, **inputs), references[variant][case], "float32", f"camera/{variant}/{case}")


def test_the_conditions_change_the_output(references):
    x, t, inputs = make_cases("camera_2.2")["45_tokens"]
    model = build_tiny_model("wan", MODELS["camera_2.2"][0], variant="camera_2.2")
    without = reference_forward(model, x, t, inputs["context"])
    assert relative_error(without, references["camera_2.2"]["45_tokens"]) > 1e-3


def test_bad_camera_conditions_are_named(files):
    groups = ParallelGroups(SPConfig(["cpu"]), 0, SeqParallel.single(), None, 0, None)
    worker = load_worker_model(LoadRequest(files["camera_2.2"]), torch.device("cpu"), groups, lambda *_: None)
    x, t, inputs = make_cases("camera_2.2")["45_tokens"]
    out = torch.empty(2, 16, 5, 6, 6)
    with pytest.raises(ValueError, match=r"camera_conditions has shape \[2, 24, 5, 6, 6\]; this Wan Fun Camera "
                                         r"model takes \[B, 24, 5, 48, 48\]"):
        worker.forward(x, t, {**inputs, "camera_conditions": inputs["camera_conditions"][..., :6, :6]}, out,
                       LocalContext(groups))


def test_the_5b_control_camera_is_refused_by_name(tmp_path):
    from sp_runtime.detection import detect
    path = write_tiny_checkpoint("wan", str(tmp_path / "fun_5b_camera.safetensors"), variant="camera_2.2",
                                 in_channels=100, out_channels=48, prefix=COMFY_PREFIX)
    with pytest.raises(ValueError, match=r"Wan 2\.2 Fun 5B Control-Camera checkpoint \(48-channel latents, 100 input"):
        detect(path)
