"""LTX-2 (audio + video) under sequence parallelism: the pool's video and audio outputs equal, at Ulysses 1-4, Ring 3,
Ulysses 2 x Ring 2 and Ulysses 2 x CFG 2 (each case where its path differs: CASES_AT_DEGREE / CASES_AT_LAYOUT), on a
tiny ComfyUI-layout file (real head sizes 128 / 64, 3 heads each, odd token counts, batch 2, audio shorter than the
degree, per-token timesteps, I2V, two guide frames at ComfyUI's keyframe_idxs positions): diffusers' stock
LTX2VideoTransformer3DModel forward on one process (its own connector forward for the prompt) with ComfyUI's two
choices hooked in (sp_lab.references.ltx2.comfy_hooks: the cross-modal gates, the video-to-audio norm), which
test_ltx2_comfy checks against ComfyUI's own LTXAVModel."""
from __future__ import annotations

import json
import math

import pytest
import torch

from family_support import FP32_TOL, assert_parity, relative_error
from sp_lab.references import ltx2 as ltx2_reference
from sp_runtime.families import ltx2
from sp_runtime.checkpoints.header import read_checkpoint_header
from sp_lab.tiny_models import COMFY_PREFIX, build_tiny_model, write_tiny_checkpoint

pytest_plugins = ["family_pools"]  # the shared per-degree worker pools
SEED = 13
CAPTION = 48  # the tiny model's text encoder width


def make_cases(seed=4):
    """(video [B, 128, F, H, W], audio [B, 8, T, 16], sigma, inputs): 45 and 30 video tokens, 7 and 2 audio
    tokens, a 9-token prompt; "i2v": the first latent frame conditioned (sigma 0), batch items at other sigmas."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    i2v_mask = torch.ones(2, 1, 3, 5, 3)
    i2v_mask[:, :, 0] = 0
    guide_mask = torch.ones(2, 1, 5, 3, 3)
    guide_mask[:, :, 3:] = 0  # two strength-1.0 guide frames appended after three latent frames
    return {
        "t2av": (rand(2, 128, 3, 5, 3), rand(2, 8, 7, 16), torch.tensor([0.7, 0.7]),
                 {"context": rand(2, 9, CAPTION), "frame_rate": 24.0}),
        "two_audio_tokens": (rand(2, 128, 2, 3, 5), rand(2, 8, 2, 16), torch.tensor([0.9, 0.9]),
                             {"context": rand(2, 5, CAPTION)}),
        "per_token_timesteps": (rand(2, 128, 3, 5, 3), rand(2, 8, 7, 16), 0.8 * torch.rand(2, 45, generator=g),
                                {"context": rand(2, 9, CAPTION), "audio_timestep": torch.rand(2, 7, generator=g)}),
        "batch_1": (rand(1, 128, 1, 4, 3), rand(1, 8, 5, 16), torch.tensor([0.5]), {"context": rand(1, 3, CAPTION)}),
        "i2v": (rand(2, 128, 3, 5, 3), rand(2, 8, 7, 16), comfy_sigmas(torch.tensor([0.8, 0.6]), i2v_mask, 7),
                {"context": rand(2, 9, CAPTION), "frame_rate": 24.0, "denoise_mask": i2v_mask}),
        "guides": (rand(2, 128, 5, 3, 3), rand(2, 8, 7, 16), comfy_sigmas(torch.tensor([0.8, 0.6]), guide_mask, 7),
                   {"context": rand(2, 9, CAPTION), "frame_rate": 24.0, "denoise_mask": guide_mask,
                    **guide_conds((0, 17), (3, 3))}),
    }


def guide_conds(frames, size, strength=1.0):
    """What LTXVAddGuide puts into the conditioning for one-frame guides at these pixel frames on a latent of `size`
    (rows, columns), batch 2: keyframe_idxs, the guide tokens' pixel bounds [2, 3, G, 2] (a one-frame guide spans one
    pixel frame from its index, ComfyUI's causal fix), and one attention entry per guide."""
    rows, cols = torch.meshgrid(torch.arange(size[0]), torch.arange(size[1]), indexing="ij")
    bounds = []
    for frame in frames:
        time = torch.full((rows.numel(),), float(frame))
        starts = torch.stack([time, rows.flatten() * 32.0, cols.flatten() * 32.0])
        bounds.append(torch.stack([starts, starts + torch.tensor([1.0, 32.0, 32.0])[:, None]], dim=-1))
    entries = [{"pre_filter_count": size[0] * size[1], "strength": strength, "pixel_mask": None,
                "latent_shape": [1, *size]} for _ in frames]
    keyframe_idxs = torch.cat(bounds, dim=1).expand(2, -1, -1, -1).contiguous()
    return {"keyframe_idxs": keyframe_idxs, "guide_attention_entries": entries}



def comfy_sigmas(sigma, denoise_mask, audio_frames):
    """The (video, audio) timesteps ComfyUI's LTXAV.process_timestep makes of a sigma [B] and a video denoise mask:
    sigma x mask per video token [B, N, 1], the audio's sigma per audio token [B, T, 1]."""
    video = (denoise_mask * sigma[:, None, None, None, None]).flatten(1).unsqueeze(-1)
    return video, sigma[:, None, None].expand(-1, audio_frames, 1)


def pool_call(handle, video, audio, sigma, inputs):
    """The call the host makes: both latents packed into x, their shapes in latent_shapes; unpacked again. A case
    with a denoise mask goes through the host's conversion of ComfyUI's call (pack_comfy_call)."""
    if "denoise_mask" in inputs:
        x, timestep, extra = ltx2.COMFY.hooks.pack([video, audio], sigma, inputs)
        return ltx2.COMFY.hooks.unpack(handle(x, timestep, **extra), [video, audio])
    x = torch.cat([video.flatten(1), audio.flatten(1)], dim=1).unsqueeze(1)
    out = handle(x, sigma, latent_shapes=[list(video.shape), list(audio.shape)], **inputs)
    split = video[0].numel()
    return out[:, 0, :split].reshape(video.shape), out[:, 0, split:].reshape(audio.shape)


def reference(model, video, audio, sigma, inputs, comfy=True):
    sigma, audio_sigma = sigma if isinstance(sigma, tuple) else (sigma, inputs.get("audio_timestep"))
    return ltx2_reference.reference_forward(model, video, audio, sigma, inputs["context"], audio_sigma,
                                  inputs.get("frame_rate", ltx2_reference.DEFAULT_FRAME_RATE), comfy=comfy,
                                  keyframe_idxs=inputs.get("keyframe_idxs"))



@pytest.fixture(scope="session")
def ltx2_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ltx2")
    return write_tiny_checkpoint("ltx2", str(folder / "ltx2.safetensors"), seed=SEED, prefix=COMFY_PREFIX)


@pytest.fixture(scope="session")
def ltx2_references():
    model = build_tiny_model("ltx2", SEED)
    return {name: reference(model, *case) for name, case in make_cases().items()}


def check_case(handle, name, references, layout):
    video, audio = pool_call(handle, *make_cases()[name])
    expected_video, expected_audio = references[name]
    assert_parity(video, expected_video, "float32", f"ltx2_video/{layout}/{name}")
    assert_parity(audio, expected_audio, "float32", f"ltx2_audio/{layout}/{name}")


# every case at Ulysses 2; elsewhere the cases whose path differs there: one device, an odd degree, uneven shards with
# the audio shorter than the degree (4: 12/11/11/11 and 8/8/7/7 video tokens, 2 audio tokens), Ring, the hybrid
# (guide tokens across four shards) and CFG halves at different sigmas (the gates over the whole call)
CASES_AT_DEGREE = {1: ("t2av", "i2v"), 3: ("t2av",), 4: ("two_audio_tokens", "i2v")}
CASES_AT_LAYOUT = {"u1r3": ("t2av",), "u2r2": ("two_audio_tokens", "guides"), "u2cfg2": ("i2v",)}


def test_fp32_parity_ulysses(family_pool, ltx2_file, ltx2_references):
    degree = family_pool.config.world_size
    handle = family_pool.load_model(ltx2_file)
    assert (handle.info.family, handle.info.variant) == ("ltx2", "av")
    for name in CASES_AT_DEGREE.get(degree, make_cases()):
        check_case(handle, name, ltx2_references, f"u{degree}")
    handle.unload()


def test_fp32_parity_ring_hybrid_and_cfg(layout_pool, ltx2_file, ltx2_references):
    layout, pool = layout_pool
    handle = pool.load_model(ltx2_file)
    for name in CASES_AT_LAYOUT[layout]:
        check_case(handle, name, ltx2_references, layout)
    handle.unload()


# tensor parallelism (its 3 heads of each modality shared out 2 / 1): TP 2 alone and with Ulysses 2 (guides across
# shards), Ring 2 and CFG 2; TP 4 is refused by name (3 heads)
CASES_AT_TP = {"tp2": ("t2av", "i2v", "guides"), "u2tp2": ("two_audio_tokens", "guides"), "r2tp2": ("t2av",),
               "cfg2tp2": ("i2v",)}


def test_fp32_parity_tensor_parallel(tp_pool, ltx2_file, ltx2_references):
    layout, pool = tp_pool
    if layout not in CASES_AT_TP:
        with pytest.raises(Exception, match="tensor_parallel_degree=4 cannot split the 3 attention heads of "
                                            "transformer_blocks.0.attn1 over 4 ranks"):
            pool.load_model(ltx2_file)
        return
    handle = pool.load_model(ltx2_file)
    for name in CASES_AT_TP[layout]:
        check_case(handle, name, ltx2_references, layout)
    handle.unload()


def test_comfyuis_choices_change_the_output(ltx2_references):
    """Guards against hooks that do nothing: diffusers' unhooked forward differs from the reference, in both
    outputs, with shared sigmas (the video-to-audio norm) and in I2V (also the gates)."""
    model = build_tiny_model("ltx2", SEED)
    for name in ("t2av", "i2v"):
        for got, other in zip(reference(model, *make_cases()[name], comfy=False), ltx2_references[name]):
            assert relative_error(got, other) > 100 * FP32_TOL


def test_guide_positions_change_the_output(ltx2_references):
    """Guards against keyframe_idxs that do nothing: the guide tokens at their own latent-grid positions (no
    keyframe_idxs) give other outputs, video and audio."""
    model = build_tiny_model("ltx2", SEED)
    video, audio, sigma, inputs = make_cases()["guides"]
    unplaced = reference(model, video, audio, sigma, {**inputs, "keyframe_idxs": None})
    for got, other in zip(unplaced, ltx2_references["guides"]):
        assert relative_error(got, other) > 100 * FP32_TOL


def test_guides_that_need_an_attention_mask_are_clear_errors():
    """A guide strength other than 1 or a guide attention mask (pixel_mask) becomes the input guide_weights (one
    weight per guide token; none at strength 1 without a mask, where ComfyUI builds no mask); an IC-LoRA guide dilated
    for reference_downscale_factor > 1 (drops tokens) is refused, naming what to change."""
    video, audio, sigma, inputs = make_cases()["guides"]
    assert "guide_weights" not in ltx2.COMFY.hooks.pack([video, audio], sigma, inputs)[2]
    weak = {**inputs, **guide_conds((0, 17), (3, 3), strength=0.7)}
    weights = ltx2.COMFY.hooks.pack([video, audio], sigma, weak)[2]["guide_weights"]
    assert weights.shape == (2, 18) and bool((weights == torch.tensor(0.7)).all())
    half = torch.ones(1, 1, 1, 24, 24)
    half[..., :12] = 0.5  # left half of the pixels at 0.5: the first latent column 0.5, the third 1, the middle 0.75
    masked = {**inputs, "guide_attention_entries": [{**entry, "pixel_mask": half}
                                                    for entry in inputs["guide_attention_entries"]]}
    weights = ltx2.COMFY.hooks.pack([video, audio], sigma, masked)[2]["guide_weights"]
    assert torch.allclose(weights[0, :3], torch.tensor([0.5, 0.75, 1.0])) and weights.shape == (2, 18)
    dilated = inputs["denoise_mask"].clone()
    dilated[:, :, 3:, 1] = -1.0
    with pytest.raises(ValueError, match="reference_downscale_factor"):
        ltx2.COMFY.hooks.pack([video, audio], sigma, {**inputs, "denoise_mask": dilated})
    with pytest.raises(ValueError, match="ref_audio"):
        ltx2.COMFY.hooks.pack([video, audio], sigma, {"ref_audio": {"tokens": torch.zeros(1)}})


def test_the_two_streams_reach_each_other(ltx2_references):
    """Guards against a test that cannot fail: audio changes the video output (audio-to-video attention), video
    the audio output (video-to-audio), the prompt and the timestep both."""
    model = build_tiny_model("ltx2", SEED)
    video, audio, sigma, inputs = make_cases()["t2av"]
    expected_video, expected_audio = ltx2_references["t2av"]
    changed = reference(model, video, torch.zeros_like(audio), sigma, inputs)
    assert relative_error(changed[0], expected_video) > 100 * FP32_TOL
    changed = reference(model, torch.zeros_like(video), audio, sigma, inputs)
    assert relative_error(changed[1], expected_audio) > 100 * FP32_TOL
    other_prompt = torch.randn(inputs["context"].shape, generator=torch.Generator().manual_seed(99))
    changed = reference(model, video, audio, sigma, {**inputs, "context": other_prompt})
    # 9 prompt tokens among 1024 connector tokens (the rest are registers): a smaller, still clear effect
    assert relative_error(changed[0], expected_video) > 10 * FP32_TOL
    assert relative_error(changed[1], expected_audio) > 10 * FP32_TOL
    changed = reference(model, video, audio, sigma * 0.5, inputs)
    assert relative_error(changed[1], expected_audio) > 100 * FP32_TOL


def test_detection_reads_shapes_and_the_release_config(ltx2_file):
    header = read_checkpoint_header(ltx2_file)
    detection = ltx2.detect(header)
    config = detection.config
    assert (detection.family, detection.prefix) == ("ltx2", COMFY_PREFIX)
    assert (config["num_attention_heads"], config["attention_head_dim"]) == (3, 128)
    assert (config["audio_num_attention_heads"], config["audio_attention_head_dim"]) == (3, 64)
    assert config["connector"]["video_embeddings_connector"] == {
        "num_attention_heads": 2, "attention_head_dim": 24, "num_layers": 1, "num_learnable_registers": 128,
        "rope_type": "split", "gated_attention": False}
    assert (detection.variant, config["gated_attn"], config["cross_attn_mod"]) == ("av", False, False)
    assert (config["rope_type"], config["rope_double_precision"], config["cross_attn_timestep_scale_multiplier"]) == (
        "split", True, 1000)
    assert config["positions"] == {"use_middle_indices_grid": True, "causal_temporal_positioning": True}
    assert json.loads(header.metadata["config"])["transformer"]["num_attention_heads"] == 3


def test_what_the_config_metadata_leaves_out_gets_comfyuis_defaults(ltx2_file):
    """ComfyUI's LTXAVModel defaults, not the release's values: interleaved rope in the transformer but split in
    the connectors, float32 rope frequencies, token starts (not middles), no causal time fix, gate factor 1 / 1000."""
    from dataclasses import replace
    header = read_checkpoint_header(ltx2_file)
    stated = json.loads(header.metadata["config"])["transformer"]
    heads = {key: value for key, value in stated.items() if key.endswith(("heads", "head_dim"))}
    config = ltx2.detect(replace(header, metadata={"config": json.dumps({"transformer": heads})})).config
    connector = config["connector"]["video_embeddings_connector"]
    assert (config["rope_type"], connector["rope_type"], config["rope_double_precision"]) == (
        "interleaved", "split", False)
    assert config["positions"] == {"use_middle_indices_grid": False, "causal_temporal_positioning": False}
    assert config["cross_attn_timestep_scale_multiplier"] / config["timestep_scale_multiplier"] == 1e-3


def test_a_caption_projection_diffusers_lacks_is_a_clear_error(ltx2_file):
    """A single-linear caption projection (ComfyUI's NormSingleLinearTextProjection, no release uses it yet)."""
    from dataclasses import replace
    header = read_checkpoint_header(ltx2_file)
    single = {key: value for key, value in header.tensors.items() if "caption_projection.linear_2" not in key}
    with pytest.raises(ValueError, match="single-linear caption projection"):
        ltx2.detect(replace(header, tensors=single))


def test_bad_calls_are_clear_errors(family_pool, ltx2_file):
    if family_pool.config.world_size != 2:
        pytest.skip("checked once")
    handle = family_pool.load_model(ltx2_file)
    video, audio, sigma, inputs = make_cases()["t2av"]
    x = torch.cat([video.flatten(1), audio.flatten(1)], dim=1).unsqueeze(1)
    with pytest.raises(Exception, match="latent_shapes"):
        handle(x, sigma, **inputs)
    with pytest.raises(Exception, match=f"context \\[B, L, {CAPTION}\\]"):
        handle(x, sigma, latent_shapes=[list(video.shape), list(audio.shape)], context=inputs["context"][..., :7])
    assert math.isfinite(pool_call(handle, video, audio, sigma, inputs)[0].sum().item())  # the pool still works


def test_comfy_call_convention_round_trip(family_pool, ltx2_file, ltx2_references):
    """What the host's proxy does with ComfyUI's LTXAV call ([video, audio] latents, (video, audio) sigmas, the
    denoise masks it already folded into the sigmas): pack for the pool, unpack to [video, audio]."""
    if family_pool.config.world_size != 2:
        pytest.skip("checked once")
    video, audio, sigma, inputs = make_cases()["t2av"]
    handle = family_pool.load_model(ltx2_file)
    x, timestep, extra = ltx2.COMFY.hooks.pack([video, audio], (sigma, sigma), {
        **inputs, "denoise_mask": torch.ones(2, 1, 3, 5, 3)})
    outputs = ltx2.COMFY.hooks.unpack(handle(x, timestep, **extra), [video, audio])
    for got, expected, what in zip(outputs, ltx2_references["t2av"], ("video", "audio")):
        assert_parity(got, expected, "float32", f"ltx2_{what}/comfy_call")
    with pytest.raises(Exception, match="keyframe_idxs has shape"):
        x, timestep, extra = ltx2.COMFY.hooks.pack([video, audio], sigma, {**inputs, "keyframe_idxs": torch.zeros(
            2, 3, 44, 2)})
        handle(x, timestep, **extra)
    with pytest.raises(ValueError, match="both latents"):
        ltx2.COMFY.hooks.pack([video, audio[:, :, :0]], sigma, {})
    assert ltx2.COMFY.attributes(handle.info)["preprocess_text_embeds"](inputs["context"]) is inputs["context"]


def test_the_host_reads_the_video_sigma_per_frame_as_comfyui_does():
    """ComfyUI's LTXAV takes each latent frame's first token's sigma unless batch item 0's denoise mask varies
    within a frame; the gates take each stream's largest sigma of the whole call."""
    video, audio = torch.zeros(2, 128, 3, 5, 3), torch.zeros(2, 8, 7, 16)
    sigma = torch.arange(90.0).reshape(2, 45, 1) / 90
    mask = torch.ones(2, 1, 3, 5, 3)
    mask[1, :, 1, 2:] = 0.5  # item 1 only
    _, timestep, extra = ltx2.COMFY.hooks.pack([video, audio], (sigma, sigma[:, :7] / 2), {"denoise_mask": mask})
    frames = sigma.reshape(2, 3, 15)[:, :, :1].expand(-1, -1, 15)
    assert torch.equal(timestep, frames.reshape(2, 45, 1))
    assert (extra["v2a_gate_sigma"], extra["a2v_gate_sigma"]) == (sigma.max(), sigma[:, :7].max() / 2)
    mask[0, :, 2, 0] = 0.5  # now item 0 varies within a frame: every token keeps its own sigma
    assert ltx2.COMFY.hooks.pack([video, audio], (sigma, sigma[:, :7]), {"denoise_mask": mask})[1] is sigma
