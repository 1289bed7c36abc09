"""Qwen-Image-Layered under Ulysses SP: the pool's output equals diffusers' forward on one process (ComfyUI's position
ids around it) at degrees 1-4 for latents of 2-4 layer frames [B, C, T, H, W], with and without the condition image
(reference latents, index or negative index), additional_t_cond 0 and 1; head size 128 with 5 heads, odd grids,
batch 2; ComfyUI's positions equal diffusers' own layered rope (condition at index -1) where the two conventions meet;
detection from the addition_t_embedding weight."""
from __future__ import annotations

import pytest
import torch

from family_support import FP32_TOL, assert_parity, relative_error
from sp_lab.conformance.cases import seeded_randn
from sp_lab.references.qwen_image import reference_forward as qwen_image_reference
from sp_runtime.families import qwen_image
from sp_runtime.checkpoints.header import read_checkpoint_header
from sp_lab.tiny_models import COMFY_PREFIX, build_tiny_model, write_tiny_checkpoint

pytest_plugins = ["family_pools"]  # the shared per-degree worker pools
SEED = 9
SIZE = dict(attention_head_dim=128, num_attention_heads=5)
LAYOUTS = {"comfy_prefix": dict(prefix=COMFY_PREFIX), "diffusers_folder": dict(layout="diffusers_folder")}


def make_cases(seed=3):
    """ComfyUI calls (x, timestep, kwargs): 3 frames of 3 x 4 tokens (odd latent, padded), 2 frames of 4 x 4 + a
    condition image at -1 with additional_t_cond (1, 0), 4 frames + a condition placed by default (at -1, as ComfyUI
    does for Layered), batch 1."""
    rand = seeded_randn(seed)
    t2 = torch.tensor([0.7, 0.3])
    return {
        "three_layers": (rand(2, 16, 3, 5, 7), t2, {"context": rand(2, 9, 32)}),
        "condition_negative_index": (rand(2, 16, 2, 8, 8), t2, {
            "context": rand(2, 9, 32), "ref_latents": [rand(2, 16, 1, 8, 8)], "ref_latents_method": "negative_index",
            "additional_t_cond": torch.tensor([1, 0])}),
        "condition_default_index": (rand(1, 16, 4, 4, 4), t2[:1], {"context": rand(1, 5, 32),
                                                                  "ref_latents": [rand(1, 16, 1, 4, 4)]}),
    }


@pytest.fixture(scope="session")
def layered_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen_layered")
    return {name: write_tiny_checkpoint("qwen_image", str(folder / name), variant="layered", seed=SEED, **SIZE, **kw)
            for name, kw in LAYOUTS.items()}


@pytest.fixture(scope="session")
def layered_model():
    return build_tiny_model("qwen_image", SEED, use_additional_t_cond=True, use_layer3d_rope=True, **SIZE)


@pytest.fixture(scope="session")
def layered_references(layered_model):
    """diffusers' forward on the in-memory model (independent of our loader and SP forward)."""
    return {name: qwen_image_reference(layered_model, *case[:2], **case[2])
            for name, case in make_cases().items()}


def test_fp32_parity(family_pool, layered_files, layered_references):
    """Every case on the ComfyUI file at every degree; the diffusers folder at degree 1."""
    for layout, path in layered_files.items():
        if layout != "comfy_prefix" and family_pool.config.world_size > 1:
            continue
        handle = family_pool.load_model(path)
        assert (handle.info.family, handle.info.variant) == ("qwen_image", "layered")
        for name, (x, t, inputs) in make_cases().items():
            assert_parity(handle(x, t, **inputs), layered_references[name], "float32", f"qwen_layered_{layout}/{name}")
        handle.unload()


def test_the_condition_the_flag_and_the_frames_matter(layered_model, layered_references):
    """Guards against a test that cannot fail."""
    x, t, inputs = make_cases()["condition_negative_index"]
    want = layered_references["condition_negative_index"]
    for changed in ({"additional_t_cond": torch.tensor([0, 0])}, {"ref_latents_method": "index"},
                    {"ref_latents": None}):
        other = qwen_image_reference(layered_model, x, t, **{**inputs, **changed})
        assert relative_error(other, want) > 100 * FP32_TOL, changed
    alone = qwen_image_reference(layered_model, x[:, :, :1], t, **inputs)
    assert relative_error(alone, want[:, :, :1]) > 100 * FP32_TOL  # the other layer frames are attended


def test_comfy_positions_equal_diffusers_layer3d_rope(layered_model, layered_references):
    """With even grids, at least as many rows / 2 as layers and the condition at -1 (negative_index), ComfyUI's ids
    are diffusers' own QwenEmbedLayer3DRope: the stock forward, its own positions, gives the same output."""
    from sp_runtime.sp.tokens import reference_pack
    x, t, inputs = make_cases()["condition_negative_index"]
    frames = [*x.unbind(2), inputs["ref_latents"][0][:, :, 0]]
    tokens = torch.cat([reference_pack(frame, 2)[0] for frame in frames], dim=1)
    with torch.no_grad():
        out = layered_model(hidden_states=tokens, encoder_hidden_states=inputs["context"], timestep=t,
                            img_shapes=[[(1, 4, 4)] * len(frames)] * 2, additional_t_cond=inputs["additional_t_cond"],
                            return_dict=False)[0]
    want = layered_references["condition_negative_index"]
    for frame in range(2):
        stock = torch.nn.functional.fold(out[:, frame * 16:(frame + 1) * 16].transpose(1, 2), (8, 8), 2, stride=2)
        assert relative_error(stock, want[:, :, frame]) <= FP32_TOL


def test_detection_and_options(layered_files, layered_model):
    for path in layered_files.values():
        detection = qwen_image.detect(read_checkpoint_header(path))
        assert detection.variant == "layered"
        assert detection.config["use_additional_t_cond"] and detection.config["use_layer3d_rope"]
        with pytest.raises(ValueError, match="told by its weights"):
            qwen_image.load_model(path, "float32", detection=detection, options={"variant": "edit_2511"})
    # ComfyUI's detection gives Layered files default_ref_method "negative_index" (the image before the layers)
    assert qwen_image.default_ref_method(layered_model.config) == "negative_index"


def test_bad_additional_t_cond_is_a_clear_error(layered_files):
    from family_support import LocalContext
    from sp_runtime.contract import LoadRequest
    from sp_runtime.groups import SeqParallel
    groups = type("Groups", (), {"seq": SeqParallel.single()})()
    path = layered_files["comfy_prefix"]
    worker = qwen_image.load(LoadRequest(path, "float32"), qwen_image.detect(read_checkpoint_header(path)),
                             torch.device("cpu"), groups, lambda *_: None)
    x, t, inputs = make_cases()["three_layers"]
    with pytest.raises(ValueError, match="additional_t_cond must be 0 or 1"):
        worker.forward(x, t, {**inputs, "additional_t_cond": torch.tensor([2, 0])}, torch.empty_like(x),
                       LocalContext(groups))
