"""LTX-2.3 and 2.5 (audio + video) under sequence parallelism: the pool's video and audio outputs equal diffusers'
LTX2VideoTransformer3DModel forward on one process for tiny ComfyUI-layout files of each release (gated attention,
prompt cross-attention AdaLN with the timestep in 2.3 and without it in 2.5, no caption projection, connectors fed
by the text encoder's video and audio features, split rotary; real head sizes 128 / 64, 3 heads each, 45 and 30
video tokens, 7 and 2 audio tokens, batch 2) at Ulysses 2 and 4 and Ulysses 2 x Ring 2 (the plan and its layouts are
LTX-2's, test_ltx2); and their all-in-one checkpoint's diffusion part."""
from __future__ import annotations

import pytest
import torch

from family_support import FP32_TOL, assert_parity, relative_error
from sp_runtime.families import ltx2
from sp_runtime.detection import detect
from sp_lab.tiny_models import COMFY_PREFIX, build_tiny_model, write_tiny_checkpoint
from sp_lab.tiny_models.ltx2 import release_metadata
from sp_lab.tiny_models.quant_files import write_quantized
from sp_lab.tiny_models.weights import pack_all_in_one
from test_ltx2 import comfy_sigmas, pool_call, reference

pytest_plugins = ["family_pools"]  # the shared per-degree worker pools
SEED = 17
FEATURES = 384 + 192  # the text encoder's video and audio features (the attention widths of the tiny models)
RELEASES = ("2.3", "2.5")


def make_cases(seed=6):
    """(video [B, 128, F, H, W], audio [B, 8, T, 16], sigma, inputs): 45 and 30 video tokens, 7 and 2 audio
    tokens, batch items at different sigmas; "i2v": the first latent frame conditioned (per-token sigmas, whose
    largest drives the prompt AdaLN)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    i2v_mask = torch.ones(2, 1, 3, 5, 3)
    i2v_mask[:, :, 0] = 0
    return {
        "t2av": (rand(2, 128, 3, 5, 3), rand(2, 8, 7, 16), torch.tensor([0.7, 0.4]),
                 {"context": rand(2, 9, FEATURES), "frame_rate": 24.0}),
        "two_audio_tokens": (rand(2, 128, 2, 3, 5), rand(2, 8, 2, 16), torch.tensor([0.9, 0.5]),
                             {"context": rand(2, 5, FEATURES)}),
        "i2v": (rand(2, 128, 3, 5, 3), rand(2, 8, 7, 16), comfy_sigmas(torch.tensor([0.8, 0.6]), i2v_mask, 7),
                {"context": rand(2, 9, FEATURES), "frame_rate": 24.0, "denoise_mask": i2v_mask}),
    }


@pytest.fixture(scope="session")
def release_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ltx23")
    return {release: write_tiny_checkpoint("ltx2", str(folder / f"ltx-{release}.safetensors"), seed=SEED,
                                           prefix=COMFY_PREFIX, release=release) for release in RELEASES}


@pytest.fixture(scope="session")
def models():
    return {release: build_tiny_model("ltx2", SEED, release=release) for release in RELEASES}


class References(dict):
    """(release, case name) -> the reference outputs, computed when first asked for."""

    def __init__(self, models):
        super().__init__()
        self.models = models

    def __missing__(self, key):
        release, name = key
        self[key] = reference(self.models[release], *make_cases()[name])
        return self[key]


@pytest.fixture(scope="session")
def references(models):
    return References(models)


def check(handle, release, names, references, layout):
    cases = make_cases()
    for name in names:
        video, audio = pool_call(handle, *cases[name])
        expected_video, expected_audio = references[release, name]
        assert_parity(video, expected_video, "float32", f"ltx{release}_video/{layout}/{name}")
        assert_parity(audio, expected_audio, "float32", f"ltx{release}_audio/{layout}/{name}")


# The plan is LTX-2's (test_ltx2 covers every layout); 2.3 / 2.5 add per-token gates and per-item prompt modulation,
# checked where shards are uneven and the audio shorter than the degree (2.3 at Ulysses 4), with per-token sigmas
# (2.3 I2V from its all-in-one file at Ulysses 2, below) and on Ulysses 2 x Ring 2 (2.5 I2V: its keyframe marker on
# the split first frame); 2.5 from its int8 file at Ulysses 2 (below)
RUNS_AT_DEGREE = {4: {"2.3": ("two_audio_tokens",)}}
RUNS_AT_LAYOUT = {"u2r2": {"2.5": ("i2v",)}}


def test_fp32_parity_ulysses(family_pool, release_files, references):
    degree = family_pool.config.world_size
    if degree not in RUNS_AT_DEGREE:
        pytest.skip("2.3 / 2.5 add nothing that differs at this degree (degree 2 runs the all-in-one file)")
    for release, names in RUNS_AT_DEGREE[degree].items():
        handle = family_pool.load_model(release_files[release])
        assert (handle.info.family, handle.info.variant) == ("ltx2", f"av-{release}")
        check(handle, release, names, references, f"u{degree}")
        handle.unload()


@pytest.mark.parametrize("tp_pool", ["tp2"], indirect=True)
def test_fp32_parity_tensor_parallel(tp_pool, release_files, references):
    """Their per-head gate logits split with the heads (LTX-2 covers the other TP layouts)."""
    layout, pool = tp_pool
    for release in RELEASES:
        handle = pool.load_model(release_files[release])
        check(handle, release, ("two_audio_tokens",), references, layout)
        handle.unload()


def check_comfy_attributes(handle):
    """What ComfyUI's LTXAV class and LTX nodes read on diffusion_model: no caption projection in 2.3 / 2.5, the
    prompt widths they split the text encoder output by; a prompt of another width is a clear error."""
    attributes = ltx2.COMFY.attributes(handle.info)
    assert (attributes["cross_attention_dim"], attributes["audio_cross_attention_dim"]) == (384, 192)
    assert (attributes["inner_dim"], attributes["audio_inner_dim"]) == (384, 192)
    assert attributes["caption_proj_before_connector"] and not attributes["caption_projection_first_linear"]
    video, audio, sigma, inputs = make_cases()["t2av"]
    with pytest.raises(Exception, match=f"context \\[B, L, {FEATURES}\\] \\(video and audio features\\)"):
        pool_call(handle, video, audio, sigma, {"context": inputs["context"][..., :48]})


def test_fp32_parity_ring_and_hybrid(layout_pool, release_files, references):
    layout, pool = layout_pool
    if layout not in RUNS_AT_LAYOUT:
        pytest.skip("Ring and CFG-parallel paths are LTX-2's: checked in test_ltx2")
    for release, names in RUNS_AT_LAYOUT[layout].items():
        handle = pool.load_model(release_files[release])
        check(handle, release, names, references, layout)
        handle.unload()


def test_the_new_pieces_change_the_outputs(models, references):
    """Guards against a test that cannot fail: the attention gates, the prompt AdaLN (2.3) and the static prompt
    table (2.5) each change both outputs of the reference the pool is compared with."""
    case = make_cases()["i2v"]

    def changed(release, parameter_suffix, value):
        model = build_tiny_model("ltx2", SEED, release=release)
        for name, parameter in model.named_parameters():
            if name.endswith(parameter_suffix):
                parameter.data.fill_(value)
        return reference(model, *case)

    for release, suffix in (("2.3", "to_gate_logits.weight"), ("2.3", "prompt_adaln.linear.weight"),
                            ("2.5", "prompt_scale_shift_table")):
        expected = references[release, "i2v"]
        for got, want in zip(changed(release, suffix, 0.0), expected):
            assert relative_error(got, want) > 100 * FP32_TOL, (release, suffix)


def test_detection_tells_the_releases_apart(release_files):
    for release, path in release_files.items():
        detection = detect(path)
        config = detection.config
        assert (detection.family, detection.variant, detection.prefix) == ("ltx2", f"av-{release}", COMFY_PREFIX)
        assert (config["gated_attn"], config["cross_attn_mod"], config["use_prompt_embeddings"]) == (True, True, False)
        assert config["use_prompt_adaln_single"] == (release == "2.3")
        assert config["ff_bias"] == (release == "2.3")
        assert config["rope_type"] == "split"
        assert config["connector"]["audio_embeddings_connector"] == {
            "num_attention_heads": 3, "attention_head_dim": 64, "num_layers": 1, "num_learnable_registers": 128,
            "rope_type": "split", "gated_attention": True}


def test_all_in_one_checkpoint_runs_its_diffusion_part(family_pool, release_files, references, tmp_path):
    """An all-in-one LTX-2.3 file (the diffusion model beside the text projection, video / audio VAEs and the
    vocoder, as `ltx-2.3-22b-dev-fp8.safetensors`): detection and the pool read its diffusion part only (Ulysses 2)."""
    if family_pool.config.world_size != 2:
        pytest.skip("Ulysses 2 only")
    g = torch.Generator().manual_seed(1)
    parts = {"text_embedding_projection.video_aggregate_embed.weight": torch.randn(384, 64, generator=g).bfloat16(),
             "text_embedding_projection.audio_aggregate_embed.weight": torch.randn(192, 64, generator=g).bfloat16(),
             "vae.decoder.conv_in.conv.weight": torch.randn(8, 4, 3, 3, 3, generator=g).bfloat16(),
             "audio_vae.decoder.conv_in.conv.weight": torch.randn(8, 4, 3, 3, generator=g).bfloat16(),
             "vocoder.conv_pre.weight": torch.randn(8, 4, 7, generator=g).bfloat16()}
    path = pack_all_in_one(release_files["2.3"], str(tmp_path / "ltx-2.3-all-in-one.safetensors"), parts)
    assert detect(path).variant == "av-2.3"
    handle = family_pool.load_model(path)
    assert handle.info.weight_dtype == "float32"  # the diffusion part's precision, not the bf16 parts'
    check(handle, "2.3", ("i2v",), references, "u2_all_in_one")
    handle.unload()


def test_int8_convrot_file_equals_its_dequantized_weights(family_pool, models, tmp_path):
    """An LTX-2.5 file as `ltx-2.5-22b-distilled-transformer-comfy-int8-convrot.safetensors` (every block Linear
    int8 with a rotation, `.comfy_quant` per layer, the release's `config` metadata) loaded in fp32 equals diffusers
    on the weights its codes encode (Ulysses 2)."""
    if family_pool.config.world_size != 2:
        pytest.skip("Ulysses 2 only")
    path, dequantized = str(tmp_path / "ltx-2.5-int8-convrot.safetensors"), str(tmp_path / "dequantized.safetensors")
    kinds = write_quantized("ltx2", path, dequantized, "comfy_quant", SEED, COMFY_PREFIX,
                            release_metadata(models["2.5"]), only="int8_tensorwise convrot", release="2.5")
    assert "transformer_blocks.0.attn1.to_gate_logits.weight" in kinds
    assert set(kinds.values()) == {"int8_tensorwise convrot"}
    handle = family_pool.load_model(path, "fp32")
    assert (handle.info.variant, handle.info.quant.split()[0]) == ("av-2.5", "comfy_quant")
    expected = reference(ltx2.load_model(dequantized, "fp32")[0], *make_cases()["t2av"])
    video, audio = pool_call(handle, *make_cases()["t2av"])
    assert_parity(video, expected[0], "float32", "ltx2.5_video/u2_int8_convrot")
    assert_parity(audio, expected[1], "float32", "ltx2.5_audio/u2_int8_convrot")
    check_comfy_attributes(handle)
    handle.unload()
