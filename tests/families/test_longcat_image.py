"""LongCat-Image beyond the conformance suite (sp_lab.conformance: every file layout, the edit model's reference,
fp32 parity at Ulysses 1-4, Ring, hybrid, CFG and TP layouts, quantized file, LoRA): the released sizes, how its
Flux-layout files are told from Flux.1's, and the rope shift ComfyUI's LongCatImage adds (so the suite's cases,
which carry it, can fail without it)."""
from __future__ import annotations

import pytest
import torch

from family_support import single_rank_worker
from sp_lab.conformance.cases import longcat_image_cases
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint
from sp_lab.tiny_models import longcat_image as tiny
from sp_runtime.checkpoints.header import Header
from sp_runtime.detection import detect as detect_any
from sp_runtime.families import longcat_image


def _released_keys(text_width: int) -> dict:
    keys = {"img_in.weight": (3072, 64), "txt_in.weight": (3072, text_width), "time_in.in_layer.weight": (3072, 256),
            "final_layer.linear.weight": (64, 3072)}
    for block in range(19):
        keys.update({f"double_blocks.{block}.img_attn.norm.key_norm.scale": (128,),
                     f"double_blocks.{block}.img_mlp.0.weight": (12288, 3072)})
    for block in range(38):
        keys[f"single_blocks.{block}.linear1.weight"] = (21504, 3072)
    return {COMFY_PREFIX + key: ("BF16", shape) for key, shape in keys.items()}


def test_released_header_and_other_flux_files():
    """longcat_image(_edit)_bf16: 24 heads of 128, 19 + 38 blocks, Qwen2.5-VL's 3584-wide text: diffusers' defaults.
    A vector-free Flux-layout file of another text width is not LongCat-Image (ComfyUI's rule): no family's."""
    detection = longcat_image.detect(Header("longcat_image_edit_bf16.safetensors", _released_keys(3584)))
    assert detection.config == {"patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38,
                                "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 3584,
                                "pooled_projection_dim": 3584, "axes_dims_rope": (16, 56, 56)}
    assert longcat_image.detect(Header("other.safetensors", _released_keys(4096))) is None
    with_pooled = {**_released_keys(3584), COMFY_PREFIX + "vector_in.in_layer.weight": ("BF16", (3072, 768))}
    assert longcat_image.detect(Header("flux.safetensors", with_pooled)) is None
    ovis = {**_released_keys(2048), COMFY_PREFIX + "double_blocks.0.img_mlp.gate_proj.weight": ("BF16", (12288, 3072)),
            COMFY_PREFIX + "txt_norm.weight": ("BF16", (2048,)),
            **{f"{COMFY_PREFIX}single_blocks.{block}.linear1.weight": ("BF16", (33792, 3072)) for block in range(38)}}
    assert longcat_image.detect(Header("ovis_image_bf16.safetensors", ovis)) is None  # Flux's layout, SwiGLU MLPs
    assert detect_any(Header("ovis_image_bf16.safetensors", ovis)).family == "ovis_image"


def test_flux_and_longcat_files_are_told_apart(tmp_path):
    for family in ("flux", "longcat_image"):
        for layout in ("original", "diffusers"):
            path = write_tiny_checkpoint(family, str(tmp_path / f"{family}_{layout}.safetensors"), seed=1,
                                         layout=layout)
            assert detect_any(path).family == family


def test_key_plan_round_trip():
    model = tiny.build_tiny_model(3)
    original = tiny.original_state_dict(model)
    plan = longcat_image.original_plan(original, tiny.tiny_config())
    ours = {target: (transform or (lambda tensor: tensor))(original[key]) for key in original
            for target, transform in plan[key]}
    assert set(ours) == set(model.state_dict())
    assert all(torch.equal(ours[key], value) for key, value in model.state_dict().items())


def test_the_rope_shift_matters(tmp_path):
    path = write_tiny_checkpoint("longcat_image", str(tmp_path / "longcat.safetensors"), seed=1, prefix=COMFY_PREFIX)
    worker, context = single_rank_worker(path)
    x, t, inputs = longcat_image_cases()["odd_latent"]
    shifted, plain = torch.empty(x.shape), torch.empty(x.shape)
    worker.forward(x, t, inputs, shifted, context)
    worker.forward(x, t, {"context": inputs["context"]}, plain, context)
    assert (shifted - plain).abs().max() > 1e-3
