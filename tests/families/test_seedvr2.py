"""SeedVR2 beyond the conformance suite (which runs the tiny 3B at every layout): the released 3B / 7B headers as
ComfyUI's detection tells them, the 7B's video-only pixel rotary against the reference, and the inputs refused by
name."""
from __future__ import annotations

import pytest
import torch

from family_support import single_rank_output, single_rank_worker
from sp_lab.conformance.cases import seedvr2_cases
from sp_lab.references.seedvr2 import reference_forward
from sp_lab.tiny_models import COMFY_PREFIX, build_tiny_model, write_tiny_checkpoint
from sp_runtime.checkpoints.header import Header
from sp_runtime.detection import detect as detect_any


def released_header(variant: str) -> Header:
    """The keys detection reads at the released sizes: 3B 2560 wide, 32 blocks (10 separate, swiglu, output norm);
    7B 3072 wide, 36 blocks each with separate GELU MLPs."""
    dim, blocks, separate = (2560, 32, 10) if variant == "3b" else (3072, 36, 36)
    keys = {"vid_in.proj.weight": (dim, 132), "txt_in.weight": (dim, 5120), "emb_in.proj_in.weight": (dim, 256),
            "vid_out.proj.weight": (64, dim), "positive_conditioning": (58, 5120),
            "negative_conditioning": (64, 5120)}
    if variant == "3b":
        keys["vid_out_norm.weight"] = (dim,)
    for block in range(blocks):
        branch = "vid" if block < separate else "all"
        keys[f"blocks.{block}.attn.proj_qkv.{branch}.weight"] = (3 * dim, dim)
        keys[f"blocks.{block}.attn.norm_q.{branch}.weight"] = (128,)
        if variant == "3b":
            keys[f"blocks.{block}.mlp.{branch}.proj_in_gate.weight"] = (6912, dim)
        else:
            keys[f"blocks.{block}.mlp.{branch}.proj_in.weight"] = (4 * dim, dim)
    return Header(f"seedvr2_{variant}_int8_convrot.safetensors",
                  {COMFY_PREFIX + key: ("BF16", shape) for key, shape in keys.items()})


@pytest.mark.parametrize("variant, facts", [
    ("3b", dict(vid_dim=2560, heads=20, num_layers=32, mm_layers=10, mlp_type="swiglu", mlp_hidden=6912,
                rope_frequencies=21)),
    ("7b", dict(vid_dim=3072, heads=24, num_layers=36, mm_layers=36, mlp_type="normal", mlp_hidden=12288,
                rope_frequencies=10))])
def test_released_headers(variant, facts):
    detection = detect_any(released_header(variant))
    assert (detection.family, detection.variant) == ("seedvr2", variant)
    assert {key: detection.config[key] for key in facts} == facts
    assert detection.config["in_channels"] == 33 and detection.config["out_channels"] == 16


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("seedvr2")
    return {variant: single_rank_worker(write_tiny_checkpoint("seedvr2", str(folder / f"{variant}.safetensors"),
                                                              seed=4, prefix=COMFY_PREFIX, variant=variant))
            for variant in ("3b", "7b")}


def test_7b_matches_the_reference(workers):
    reference = build_tiny_model("seedvr2", 4, variant="7b")
    for name in ("video_75_tokens", "windows_572_tokens"):
        x, t, inputs = seedvr2_cases()[name]
        expected = reference_forward(reference, x, t, **inputs)
        assert (single_rank_output(workers["7b"], x, t, inputs) - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_refusals_by_name(workers):
    x, t, inputs = seedvr2_cases()["video_75_tokens"]
    worker = workers["3b"]
    with pytest.raises(ValueError, match="needs condition"):
        single_rank_output(worker, x, t, {"context": inputs["context"]})
    with pytest.raises(ValueError, match="even latent height and width"):
        single_rank_output(worker, x[..., :5], t, {**inputs, "condition": inputs["condition"][..., :5]})
    with pytest.raises(ValueError, match=r"condition has shape \(2, 16, 5, 6, 10\)"):
        single_rank_output(worker, x, t, {**inputs, "condition": inputs["condition"][:, :16]})
    with pytest.raises(ValueError, match=r"x has shape \(2, 17, 5, 6, 10\)"):
        single_rank_output(worker, torch.cat([x, x[:, :1]], 1), t, inputs)
