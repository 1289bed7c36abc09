"""Wan HuMo under Ulysses SP: ComfyUI's audio_embed (frame-local audio cross-attention in every block) and
reference_latent (appended frames, zero audio) equal a single-process diffusers forward with the audio step hooked
in (sp_lab.references.wan.reference_forward with audio_reference_hooks: whole-sequence attention regrouped per frame as
ComfyUI does), at degrees 1-4
(3 heads), token ranges that split frames, padded sizes, batch 2; a bad audio_embed is named."""
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

SEED = 13
SIZE = dict(num_attention_heads=3, attention_head_dim=32)  # 3 heads: 2 and 4 ranks do not divide them


def make_cases() -> dict:
    """(x, timestep, kwargs) as ComfyUI's WAN21_HuMo passes them: 45 tokens (5 frames of 9), 40 with H and W padded,
    18 + 6 reference tokens (W padded), 1 token with batch 1, and no audio."""
    g = torch.Generator().manual_seed(1)

    def call(batch, frames, height, width, audio=True, reference_frames=0):
        inputs = {"context": torch.randn(batch, 7, 32, generator=g)}
        if audio:
            inputs["audio_embed"] = torch.randn(batch, frames, 2, 5, 8, generator=g)
        if reference_frames:
            inputs["reference_latent"] = torch.randn(batch, 16, reference_frames, height, width, generator=g)
        return torch.randn(batch, 16, frames, height, width, generator=g), torch.tensor([700.0, 300.0])[:batch], \
            inputs

    return {"45_tokens": call(2, 5, 6, 6), "40_tokens_padded": call(2, 2, 7, 9),
            "reference_frame": call(2, 3, 4, 5, reference_frames=1), "1_token_batch_1": call(1, 1, 2, 2),
            "no_audio": call(2, 2, 4, 4, audio=False)}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_checkpoint("wan", str(tmp_path_factory.mktemp("wan_humo") / "humo.safetensors"), seed=SEED,
                                 variant="humo", prefix=COMFY_PREFIX, **SIZE)


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("wan", SEED, variant="humo", **SIZE)


@pytest.fixture(scope="module")
def references(model):
    return {name: reference_forward(model, x, t, **inputs) for name, (x, t, inputs) in make_cases().items()}


def test_fp32_parity(family_pool, path, references):
    handle = family_pool.load_model(path)
    assert (handle.info.variant, handle.info.config["num_heads"]) == ("humo", 3)
    for name, (x, t, inputs) in make_cases().items():
        assert_parity(handle(x, t, **inputs), references[name], "float32", f"humo/{name}")


def test_the_audio_and_the_reference_change_the_output(model, references):
    x, t, inputs = make_cases()["reference_frame"]
    silent = reference_forward(model, x, t, inputs["context"], audio_embed=torch.zeros_like(inputs["audio_embed"]),
                                   reference_latent=inputs["reference_latent"])
    assert relative_error(silent, references["reference_frame"]) > 1e-3
    alone = reference_forward(model, x, t, inputs["context"], audio_embed=inputs["audio_embed"])
    assert relative_error(alone, references["reference_frame"]) > 1e-3


def test_a_bad_audio_embed_is_named(path):
    groups = ParallelGroups(SPConfig(["cpu"]), 0, SeqParallel.single(), None, 0, None)
    worker = load_worker_model(LoadRequest(path), torch.device("cpu"), groups, lambda *_: None)
    x, t, inputs = make_cases()["45_tokens"]
    with pytest.raises(ValueError, match=r"audio_embed has shape \[2, 4, 2, 5, 8\]; this Wan HuMo model takes "
                                         r"\[B, 5, window, blocks, channels\]"):
        worker.forward(x, t, {**inputs, "audio_embed": inputs["audio_embed"][:, :4]}, torch.empty(x.shape),
                       LocalContext(groups))
