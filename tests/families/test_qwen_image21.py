"""Qwen-Image 2.1 under Ulysses SP: the pool's output equals diffusers' stock forward on one process (fed ComfyUI's
call translated to diffusers' convention) at degrees 1-4, for ComfyUI files with and without prefix, diffusers files
and folders; head size 128 with 5 heads (no degree divides them), odd joint lengths, batch 2, references spliced
into the text at image slots (block-causal mask), text padding masks; the fused-MLP key plan equals diffusers'
converter at full width; LoRAs on the fused MLP; Ring and Ulysses x Ring apply the mask exactly per block pair."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from family_support import FP32_TOL, assert_parity, relative_error
from sp_lab.references.qwen_image21 import reference_forward as qwen_image21_reference
from sp_runtime.families import flux, qwen_image, qwen_image21
from sp_runtime.checkpoints.header import read_checkpoint_header
from sp_lab.tiny_models import COMFY_PREFIX, build_tiny_model, write_tiny_checkpoint

pytest_plugins = ["family_pools"]  # the shared per-degree worker pools
SEED = 7
LAYOUTS = {"comfy_prefix": dict(prefix=COMFY_PREFIX), "diffusers": dict(layout="diffusers"),
           "diffusers_folder": dict(layout="diffusers_folder", max_shard_size="20MB")}


def make_cases(seed=4):
    """ComfyUI calls (x, timestep, kwargs); joint lengths 29, 65, 53 and 45 (text + references + target)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    t2 = torch.tensor([0.7, 0.3])
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0  # the second prompt is shorter: padding that must not be attended
    refs = [rand(2, 16, 3, 4), rand(2, 16, 4, 6)]  # the second: other row parity than the target (half-token ids)
    return {
        "t2i": (rand(2, 16, 5, 4), t2, {"context": rand(2, 9, 32)}),
        "edit_slots_masked": (rand(2, 16, 5, 4), t2, {"context": rand(2, 9, 32), "ref_latents": refs,
                                                      "image_slots": [2, 5], "attention_mask": mask}),
        "refs_after_text": (rand(1, 16, 4, 4), t2[:1], {"context": rand(1, 5, 32), "ref_latents": [rand(1, 16, 4, 6)]}),
        "adjacent_refs": (rand(2, 16, 5, 4), t2, {"context": rand(2, 9, 32), "ref_latents": refs,
                                                  "image_slots": [4, 4]}),
    }


@pytest.fixture(scope="session")
def q21_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen21")
    return {name: write_tiny_checkpoint("qwen_image21", str(folder / name), seed=SEED, **kw)
            for name, kw in LAYOUTS.items()}


@pytest.fixture(scope="session")
def q21_references():
    """Stock diffusers outputs from the in-memory model (independent of our loader, key plan and SP forward)."""
    model = build_tiny_model("qwen_image21", SEED)
    return {name: qwen_image21_reference(model, *case[:2], **case[2]) for name, case in make_cases().items()}


def test_fp32_parity_every_layout(family_pool, q21_files, q21_references):
    """Every case on the ComfyUI file; the other layouts (loading differs, the forward does not) at degree 1."""
    for layout, path in q21_files.items():
        if layout != "comfy_prefix" and family_pool.config.world_size > 1:
            continue
        handle = family_pool.load_model(path)
        assert (handle.info.family, handle.info.weight_dtype) == ("qwen_image21", "float32")
        for name, (x, t, inputs) in make_cases().items():
            if layout == "comfy_prefix" or name == "edit_slots_masked":
                assert_parity(handle(x, t, **inputs), q21_references[name], "float32", f"qwen21_{layout}/{name}")
        handle.unload()


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


def test_fp32_parity_ring_and_hybrid(layout_pool, q21_files, q21_references):
    """The block-causal mask through sp_attention's mask extension, per query block x key block (old: refused)."""
    name, pool = layout_pool
    handle = pool.load_model(q21_files["comfy_prefix"])
    for case, (x, t, inputs) in make_cases().items():
        assert_parity(handle(x, t, **inputs), q21_references[case], "float32", f"qwen21_{name}/{case}")
    handle.unload()
