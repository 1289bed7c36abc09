"""Qwen-Image 2.1 under Ulysses SP, what is special to it (test_family_conformance.py checks its parity against
diffusers' stock forward, fed ComfyUI's call translated to diffusers' convention, at every degree and layout (Ring and
Ulysses x Ring apply the block-causal mask per block pair), its file layouts, a quantized file and a LoRA, from
sp_lab.conformance: head size 128 with 5 heads, odd joint lengths, batch 2, references spliced into the text at
image slots, text padding masks): detection; the fused-MLP key plan equals diffusers' converter at full width;
LoRAs on the fused MLP."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from family_support import FP32_TOL, assert_parity, relative_error
from sp_lab.conformance.cases import qwen_image21_cases as make_cases
from sp_lab.references.qwen_image21 import reference_forward as qwen_image21_reference
from sp_runtime.families import flux, qwen_image, qwen_image21
from sp_runtime.checkpoints.header import read_checkpoint_header
from sp_lab.tiny_models import COMFY_PREFIX, build_tiny_model, write_tiny_checkpoint

pytest_plugins = ["family_pools"]  # the shared per-degree worker pools
SEED = 7
LAYOUTS = {"comfy_prefix": dict(prefix=COMFY_PREFIX), "diffusers": dict(layout="diffusers"),
           "diffusers_folder": dict(layout="diffusers_folder", max_shard_size="20MB")}


@pytest.fixture(scope="session")
def q21_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen21")
    return {name: write_tiny_checkpoint("qwen_image21", str(folder / name), seed=SEED, **kw)
            for name, kw in LAYOUTS.items()}


@pytest.fixture(scope="session")
def q21_references(family_subject):
    """The conformance suite's outputs (same seed and cases)."""
    return family_subject("qwen_image21").outputs


def test_the_mask_the_slots_and_the_references_matter(q21_references):
    """Guards against a test that cannot fail: masking, slot positions and references change the output."""
    model = build_tiny_model("qwen_image21", SEED)
    x, t, inputs = make_cases()["edit_slots_masked"]
    unmasked = qwen_image21_reference(model, x, t, **{**inputs, "attention_mask": None})
    want = q21_references["edit_slots_masked"]
    assert relative_error(unmasked[1:], want[1:]) > 100 * FP32_TOL
    assert relative_error(unmasked[:1], want[:1]) <= FP32_TOL
    moved = qwen_image21_reference(model, x, t, **{**inputs, "image_slots": [4, 4]})
    assert relative_error(moved, want) > 100 * FP32_TOL
    assert relative_error(q21_references["t2i"], want) > 100 * FP32_TOL


def test_detection_tells_the_families_apart(q21_files):
    expected = {"comfy_prefix": ("original", COMFY_PREFIX), "diffusers": ("diffusers", ""),
                "diffusers_folder": ("diffusers", "")}
    for layout, path in q21_files.items():
        header = read_checkpoint_header(path)
        detection = qwen_image21.detect(header)
        assert (detection.layout, detection.prefix) == expected[layout]
        assert detection.config["num_attention_heads"] == 5 and detection.config["attention_head_dim"] == 128
        assert detection.config["axes_dims_rope"] == (16, 56, 56) and detection.config["mlp_ratio"] == 3
        assert qwen_image.detect(header) is None and flux.detect(header) is None


def test_real_size_header_reads_as_32_heads_of_128(tmp_path):
    """The released width (32 x 128, 32 blocks, 4096 text features), from a header of empty-data tensors."""
    keys = {}
    for key, shape in {"img_in.weight": (4096, 64), "txt_in.in_layer.weight": (4096, 4096),
                       "txt_in.text_norm.weight": (4096,), "modulation.1.weight": (16384, 4096),
                       "norm_out.linear.weight": (4096, 4096), "proj_out.weight": (64, 4096)}.items():
        keys[key] = ("BF16", shape)
    for block in range(32):
        keys[f"transformer_blocks.{block}.attn.norm_q.weight"] = ("BF16", (128,))
        keys[f"transformer_blocks.{block}.img_mlp.gate_up.weight"] = ("BF16", (24576, 4096))
    config = qwen_image21.architecture(keys, fused=True)
    assert config == {"patch_size": 1, "in_channels": 64, "out_channels": 64, "num_layers": 32,
                      "attention_head_dim": 128, "num_attention_heads": 32, "context_in_dim": 4096, "mlp_ratio": 3,
                      "axes_dims_rope": (16, 56, 56), "causal_condition": True}


def test_key_plan_equals_diffusers_converter_at_full_width():
    """ComfyUI's fused [gate; up] at the released width (4096, MLP 12288), rows tagged by index (no real memory)."""
    from diffusers.loaders.single_file_utils import convert_qwen_image21_transformer_checkpoint_to_diffusers
    fused = torch.arange(2 * 12288, dtype=torch.float32)[:, None].expand(-1, 4096)
    other = torch.zeros(4096, 4096)
    checkpoint = {COMFY_PREFIX + "transformer_blocks.3.img_mlp.gate_up.weight": fused,
                  COMFY_PREFIX + "transformer_blocks.3.attn.to_q.weight": other}
    want = convert_qwen_image21_transformer_checkpoint_to_diffusers(dict(checkpoint))
    config = {"mlp_ratio": 3, "num_attention_heads": 32, "attention_head_dim": 128}
    plan = qwen_image21.original_plan([key[len(COMFY_PREFIX):] for key in checkpoint], config)
    got = {}
    for source, targets in plan.items():
        for name, transform in targets:
            tensor = checkpoint[COMFY_PREFIX + source]
            got[name] = tensor if transform is None else transform(tensor)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[name], want[name]) for name in want)


def test_lora_on_the_fused_mlp_splits_like_the_weight(q21_files, tmp_path):
    """A ComfyUI-named LoRA of the fused gate_up reaches gate_layer (first rows) and proj (last rows)."""
    from sp_runtime.lora.apply import LoraState
    path = q21_files["comfy_prefix"]
    model = qwen_image21.load_model(path, "float32")[0]
    before = {name: value.clone() for name, value in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    rows, width, rank, alpha, strength = 3 * 640, 640, 4, 2.0, 0.7
    up, down = torch.randn(2 * rows, rank, generator=g), torch.randn(rank, width, generator=g)
    stem = "diffusion_model.transformer_blocks.1.img_mlp.gate_up"
    lora = str(tmp_path / "gate_up_lora.safetensors")
    save_file({f"{stem}.lora_B.weight": up, f"{stem}.lora_A.weight": down, f"{stem}.alpha": torch.tensor(alpha)},
              lora)
    state = LoraState(model, "qwen_image21", path, torch.device("cpu"))
    assert state.set([[lora, strength]])["parameters"] == 2
    delta = strength * alpha / rank * (up @ down)
    after = model.state_dict()
    for name, part in (("gate_layer", delta[:rows]), ("proj", delta[rows:])):
        key = f"transformer_blocks.1.img_mlp.{name}.weight"
        assert relative_error(after[key], before[key] + part) <= 1e-6, key
    state.set([])
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
