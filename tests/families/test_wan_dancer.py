"""Wan 2.2 Dancer under SP: ComfyUI's music features (audio_embed) encoded and injected after blocks 0 and 4 group by
group, the reference image's CLIP context (clip_fea_ref) ahead of clip_fea's, global mode (fps 15 / 10: its own patch
embedding and head, frames 30 / fps apart) and local mode (fps 30), audio_inject_scale, equal a single-device
whole-sequence forward over diffusers' stock blocks (sp_lab.references.wan_tokens) at Ulysses 1-4 (6 heads), Ring 3,
Ulysses 2 x Ring 2 and Ulysses 2 x CFG 2, fp32, padded and odd sizes, injection groups cut by shard boundaries, batch
2, fewer tokens than ranks, and at TP 2; detection of the released layout (fused music attention); bad inputs named."""
from __future__ import annotations

import pytest
import torch

from family_support import assert_parity, relative_error, single_rank_worker
from sp_lab.references.wan_tokens import dancer_reference_forward
from sp_lab.tiny_models import COMFY_PREFIX, build_tiny_model, write_tiny_checkpoint

pytest_plugins = ["family_pools"]  # the shared per-degree and per-layout worker pools

SEED = 31


def cases() -> dict:
    """(x, timestep, inputs) as ComfyUI's WAN22_WanDancer passes them: global mode with 2 frames of 4 x 6 tokens
    (x 7 x 11, padded; 16 groups of 3 tokens), local mode with 3 frames of 8 tokens, and 1 frame of 2 x 2 tokens
    with batch 1 and no music."""
    g = torch.Generator().manual_seed(SEED)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    def call(batch, frames, height, width, **inputs):
        inputs = {"context": rand(batch, 512, 32), **inputs}
        return rand(batch, 36, frames, height, width), torch.tensor([700.0, 300.0])[:batch], inputs

    return {"global": call(2, 2, 7, 11, clip_fea=rand(2, 5, 1280), clip_fea_ref=rand(2, 4, 1280),
                           audio_embed=rand(2, 13, 35), fps=15.0, audio_inject_scale=0.7),
            "local": call(2, 3, 8, 4, clip_fea=rand(2, 5, 1280), audio_embed=rand(2, 9, 35), fps=30.0),
            "4_tokens_batch_1": call(1, 1, 4, 3, clip_fea_ref=rand(1, 3, 1280), fps=10.0)}


@pytest.fixture(scope="session")
def dancer_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wan_dancer")
    return write_tiny_checkpoint("wan", str(folder / "wan2.2_dancer_14b_global.safetensors"), seed=SEED,
                                 variant="dancer", prefix=COMFY_PREFIX)


@pytest.fixture(scope="session")
def references():
    model = build_tiny_model("wan", SEED, variant="dancer")
    return {case: dancer_reference_forward(model, x, t, **inputs) for case, (x, t, inputs) in cases().items()}


def _check(pool, path, references, what):
    handle = pool.load_model(path)
    assert handle.info.variant == "dancer" and handle.info.config["music_inject_layers"] == [0, 4]
    for case, (x, t, inputs) in cases().items():
        assert_parity(handle(x, t, **inputs), references[case], "float32", f"dancer/{what}/{case}")
    handle.unload()


def test_fp32_parity_every_ulysses_degree(family_pool, dancer_file, references):
    _check(family_pool, dancer_file, references, f"degree{family_pool.config.world_size}")


def test_fp32_parity_ring_hybrid_and_cfg(layout_pool, dancer_file, references):
    layout, pool = layout_pool
    _check(pool, dancer_file, references, layout)


@pytest.mark.parametrize("tp_pool", ["tp2"], indirect=True)
def test_fp32_parity_tensor_parallel(tp_pool, dancer_file, references):
    """TP 2: the blocks split as Wan's (6 heads, 3 per rank), the music injector, global patch embedding and head
    whole."""
    _check(tp_pool[1], dancer_file, references, "tp2")


def test_detection_and_key_plan(dancer_file):
    """The released layout (fused in_proj of the music attention) loads as the model's weights; ComfyUI's model
    class is named."""
    from sp_runtime.detection import detect
    from sp_runtime.families.wan import COMFY, load_model
    detection = detect(dancer_file)
    assert (detection.family, detection.variant) == ("wan", "dancer")
    assert detection.config["dancer"]["inject_layers"] == [0, 4]
    assert COMFY.model_classes["dancer"] == "WAN22_WanDancer"
    loaded = load_model(dancer_file, "float32")[0].state_dict()
    built = build_tiny_model("wan", SEED, variant="dancer").state_dict()
    assert set(loaded) == set(built)
    assert all(torch.equal(loaded[key], built[key]) for key in built)


def test_the_conditions_change_the_output(references):
    """Guard: without the music, the reference image, global mode or the scale the reference differs."""
    model = build_tiny_model("wan", SEED, variant="dancer")
    x, t, inputs = cases()["global"]
    want = references["global"]
    for changed in ({"audio_embed": None}, {"clip_fea_ref": None}, {"fps": 30.0}, {"fps": 10.0},
                    {"audio_inject_scale": 1.0}):
        assert relative_error(dancer_reference_forward(model, x, t, **{**inputs, **changed}), want) > 1e-3, changed


def test_bad_inputs_are_named(dancer_file):
    worker, context = single_rank_worker(dancer_file)
    x, t, inputs = cases()["global"]
    out = torch.empty(2, 16, 2, 7, 11)
    with pytest.raises(ValueError, match=r"audio_embed has shape \[2, 13, 34\]; Wan Dancer takes music features "
                                         r"\[B, N, 35\]"):
        worker.forward(x, t, {**inputs, "audio_embed": inputs["audio_embed"][..., 1:]}, out, context)
    with pytest.raises(ValueError, match=r"clip_fea_ref has shape \[2, 1280\]"):
        worker.forward(x, t, {**inputs, "clip_fea_ref": inputs["clip_fea_ref"][:, 0]}, out, context)
    for name in ("time_dim_concat", "reference_latent"):
        with pytest.raises(ValueError, match=f"{name} is not taken by ulysses-sp's Wan Dancer"):
            worker.forward(x, t, {**inputs, name: x}, out, context)
    with pytest.raises(ValueError, match="ScaleROPE's rope_options are not applied to Wan dancer models"):
        worker.forward(x, t, {**inputs, "rope_options": {"scale_x": 2.0}}, out, context)
    with pytest.raises(ValueError, match="fps is 0.0"):
        worker.forward(x, t, {**inputs, "fps": 0.0}, out, context)
    small = x[:, :, :, :4, :6]  # 2 x 3 tokens per frame: not 8 equal groups
    with pytest.raises(ValueError, match="splits each latent frame's 6 tokens into 8 equal groups"):
        worker.forward(small, t, inputs, torch.empty(2, 16, 2, 4, 6), context)


def test_other_wan_variants_refuse_dancer_inputs(tmp_path):
    """A plain Wan I2V given Dancer's inputs names them instead of dropping them."""
    path = write_tiny_checkpoint("wan", str(tmp_path / "i2v.safetensors"), seed=2, variant="i2v", prefix=COMFY_PREFIX)
    worker, context = single_rank_worker(path)
    x, t, inputs = cases()["local"]
    with pytest.raises(ValueError, match="audio_embed belongs to a Wan variant"):
        worker.forward(x, t, {"context": inputs["context"], "audio_embed": inputs["audio_embed"]},
                       torch.empty(2, 16, 3, 8, 4), context)
    with pytest.raises(ValueError, match="clip_fea_ref belongs to a Wan variant"):
        worker.forward(x, t, {"context": inputs["context"], "clip_fea_ref": torch.zeros(1, 3, 1280)},
                       torch.empty(2, 16, 3, 8, 4), context)
