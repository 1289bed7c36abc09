"""Kandinsky 5 beyond the conformance suite (sp_lab.conformance: the video model's files, fp32 parity at Ulysses 1-4,
Ring, hybrid and CFG layouts with image to video's time_dim_replace, quantized file, LoRA): the image model (4-D
latents, its own ComfyUI class) against the reference at two ranks' worth of layouts on one worker, the released
sizes as ComfyUI's detection fixes them, and a file of another input width refused by name."""
from __future__ import annotations

import pytest
import torch

from family_support import assert_parity, single_rank_worker
from sp_lab.conformance.cases import seeded_randn
from sp_lab.references.kandinsky5 import reference_forward
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint
from sp_lab.tiny_models.kandinsky5 import build_tiny_model
from sp_runtime.checkpoints.header import Header
from sp_runtime.detection import detect as detect_any
from sp_runtime.families import kandinsky5

pytest_plugins = ["family_pools"]  # tp_pool: the tensor-parallel layouts


def image_cases(seed=16):
    rand = seeded_randn(seed)
    return {"odd_image": (rand(2, 16, 7, 9), torch.tensor([800.0, 200.0]), {"context": rand(2, 6, 32),
                                                                          "y": rand(2, 24)})}


def test_image_model_takes_4d_latents(tmp_path):
    path = write_tiny_checkpoint("kandinsky5", str(tmp_path / "image.safetensors"), seed=16, prefix=COMFY_PREFIX,
                                 variant="image")
    worker, context = single_rank_worker(path)
    assert (worker.info.variant, worker.info.x_ndim, worker.info.in_channels) == ("image", 4, 16)
    x, t, inputs = image_cases()["odd_image"]
    out = torch.empty(x.shape)
    worker.forward(x, t, inputs, out, context)
    assert_parity(out, reference_forward(build_tiny_model(16, "image"), x, t, **inputs), "float32",
                  "kandinsky5/image")
    with pytest.raises(ValueError, match="needs y"):
        worker.forward(x, t, {"context": inputs["context"]}, out, context)


def released_header(model_dim: int, in_features: int) -> Header:
    """Kandinsky 5 Lite (video: 1792 wide, 132 input features; image: 2560, 64), Qwen2.5-VL and CLIP text."""
    keys = {"visual_embeddings.in_layer.weight": (model_dim, in_features),
            "out_layer.out_layer.weight": (64, model_dim),
            "time_embeddings.in_layer.bias": (512,), "text_embeddings.in_layer.weight": (model_dim, 3584),
            "pooled_text_embeddings.in_layer.weight": (512, 768)}
    for block in range(2):
        keys[f"text_transformer_blocks.{block}.self_attention.to_query.weight"] = (model_dim, model_dim)
    for block in range(32):
        keys[f"visual_transformer_blocks.{block}.cross_attention.key_norm.weight"] = (128,)
        keys[f"visual_transformer_blocks.{block}.feed_forward.in_layer.weight"] = (4 * model_dim, model_dim)
    return Header("kandinsky5lite.safetensors", {key: ("BF16", shape) for key, shape in keys.items()})


def test_released_headers_and_refused_widths():
    video = detect_any(released_header(1792, 132))
    assert (video.family, video.variant) == ("kandinsky5", "video")
    assert (video.config["axes_dims"], video.config["rope_scale_factor"], video.config["in_text_dim"]) == \
        ((16, 24, 24), (1.0, 2.0, 2.0), 3584)
    image = detect_any(released_header(2560, 64))
    assert (image.variant, image.config["axes_dims"], image.config["rope_scale_factor"]) == \
        ("image", (32, 48, 48), (1.0, 1.0, 1.0))
    with pytest.raises(ValueError, match="taking 20 latent channels"):
        detect_any(released_header(1792, 80))


@pytest.mark.parametrize("tp_pool", ["tp4", "u2tp2", "r2tp2", "cfg2tp2"], indirect=True)
def test_tensor_parallel_with_the_other_axes(tp_pool, family_subject):
    """Beyond the suite's TP 2: TP 4 (5 heads shared out 2 / 1 / 1 / 1) and TP 2 with Ulysses 2, Ring 2 or CFG 2,
    the video model's odd latent and image to video."""
    layout, pool = tp_pool
    subject = family_subject("kandinsky5")
    handle = pool.load_model(subject.path, **subject.spec.load_options)
    cases = subject.spec.cases()
    for case in ("odd_video", "i2v"):
        x, t, inputs = cases[case]
        assert_parity(handle(x, t, **inputs), subject.outputs[case], "float32", f"kandinsky5_{layout}/{case}")
    handle.unload()
