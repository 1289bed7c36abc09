"""Wan Fun Control under Ulysses SP: ComfyUI's reference_latent through ref_conv (Fun Control v1.1 with CLIP and 48
channels; Wan 2.2 Fun A14B style, 52 channels and no CLIP, its high- and low-noise experts as two models in one pool;
Wan 2.2 Fun 5B Control, 148 channels and a 48-channel reference, and Fun 5B InP, 100 channels, both with TI2V 5B's
per-frame timesteps, 3 heads of 128) equals a single-process diffusers forward (the reference frame's tokens first,
frame 0 of the rotary grid) at degrees 1-4 (6 or 3 heads), odd and padded token counts, batch 2; a bad reference
latent is named."""
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

# name -> (tiny variant, seed, input channels, CLIP tokens, text tokens, size)
FIVE_B = dict(num_attention_heads=3, attention_head_dim=128)  # 3 heads: 2 and 4 ranks do not divide them
MODELS = {"fun_control": ("fun_control", 7, 48, 5, 512, {}),
          "a14b_high_noise": ("fun_a14b", 8, 52, 0, 7, {}), "a14b_low_noise": ("fun_a14b", 9, 52, 0, 7, {}),
          "5b_control": ("fun_5b_control", 10, 148, 0, 7, FIVE_B), "5b_inp": ("fun_5b_inp", 11, 100, 0, 7, FIVE_B)}
# the 5B models are wider: the cases that differ for them (suite time)
FIVE_B_CASES = {"5b_control": ("45_tokens", "40_tokens_padded"), "5b_inp": ("40_tokens_padded",)}


def make_cases(name: str) -> dict:
    """(x, timestep, kwargs) as ComfyUI's WAN21 / WAN22 passes them. Video tokens: 45 (+9 reference tokens), 40 with
    H and W padded (+20), 1 with batch 1 (+1); and a call without reference_latent (Fun Control v1.0 workflows). The
    5B models get TI2V 5B's per-frame timesteps [B, T] (the start frame's 0, as its denoise mask makes them) and
    48-channel latents."""
    variant, seed, channels, clip_tokens, text_tokens, _ = MODELS[name]
    latent_channels = 48 if variant.startswith("fun_5b") else 16
    g = torch.Generator().manual_seed(seed)

    def call(batch, frames, height, width, reference=True):
        inputs = {"context": torch.randn(batch, text_tokens, 32, generator=g)}
        if clip_tokens:
            inputs["clip_fea"] = torch.randn(batch, clip_tokens, 1280, generator=g)
        if reference:
            inputs["reference_latent"] = torch.randn(batch, latent_channels, height, width, generator=g)
        timestep = torch.tensor([700.0, 300.0])[:batch]
        if latent_channels == 48:
            timestep = timestep[:, None].repeat(1, frames)
            timestep[:, 0] = 0.0
        return torch.randn(batch, channels, frames, height, width, generator=g), timestep, inputs

    cases = {"45_tokens": call(2, 5, 6, 6), "40_tokens_padded": call(2, 2, 7, 9), "1_token_batch_1": call(1, 1, 2, 2),
             "no_reference": call(2, 3, 4, 6, reference=False)}
    return cases if latent_channels == 16 else {case: cases[case] for case in FIVE_B_CASES[name]}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wan_fun")
    return {name: write_tiny_checkpoint("wan", str(folder / f"{name}.safetensors"), seed=seed, variant=variant,
                                        prefix=COMFY_PREFIX, **size)
            for name, (variant, seed, *_rest, size) in MODELS.items()}


@pytest.fixture(scope="module")
def references():
    """diffusers' stock forward on in-memory weights (independent of our loader, key plan and SP forward)."""
    refs = {}
    for name, (variant, seed, *_rest, size) in MODELS.items():
        model = build_tiny_model("wan", seed, variant=variant, **size)
        refs[name] = {case: reference_forward(model, x, t, **inputs)
                      for case, (x, t, inputs) in make_cases(name).items()}
    return refs


def test_fp32_parity_with_both_experts_in_one_pool(family_pool, files, references):
    handles = {name: family_pool.load_model(path) for name, path in files.items()}
    assert handles["fun_control"].info.variant == "fun_control"
    assert handles["a14b_high_noise"].info.variant == "i2v_concat"
    assert handles["a14b_low_noise"].info.config["ref_in_channels"] == 16
    assert handles["5b_control"].info.variant == handles["5b_inp"].info.variant == "ti2v"
    assert handles["5b_control"].info.config["ref_in_channels"] == 48
    for case in ("45_tokens", "40_tokens_padded", "1_token_batch_1", "no_reference"):
        for name, handle in handles.items():  # the experts alternate, as a two-stage Wan 2.2 sampling does
            cases = make_cases(name)
            if case in cases:
                x, t, inputs = cases[case]
                assert_parity(handle(x, t, **inputs), references[name][case], "float32", f"fun/{name}/{case}")


def test_the_reference_changes_the_output(references):
    model = build_tiny_model("wan", 7, variant="fun_control")
    x, t, inputs = make_cases("fun_control")["45_tokens"]
    other = reference_forward(model, x, t, **{**inputs, "reference_latent": torch.zeros_like(
        inputs["reference_latent"])})
    assert relative_error(other, references["fun_control"]["45_tokens"]) > 1e-3


def test_a_bad_reference_latent_is_named(files):
    groups = ParallelGroups(SPConfig(["cpu"]), 0, SeqParallel.single(), None, 0, None)
    worker = load_worker_model(LoadRequest(files["fun_control"]), torch.device("cpu"), groups, lambda *_: None)
    x, t, inputs = make_cases("fun_control")["45_tokens"]
    with pytest.raises(ValueError, match=r"reference_latent has shape \[2, 16, 1, 6, 6\]; this Wan Fun model takes "
                                         r"\[B, 16, 6, 6\]"):
        worker.forward(x, t, {**inputs, "reference_latent": inputs["reference_latent"].unsqueeze(2)},
                       torch.empty(2, 16, 5, 6, 6), LocalContext(groups))
