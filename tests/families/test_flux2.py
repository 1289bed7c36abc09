"""Flux.2 under Ulysses SP, what is special to it (test_family_conformance.py checks dev's parity against diffusers'
stock forward, ComfyUI's call and position ids around it, at every degree and layout, its file layouts, a quantized
file and a LoRA, from sp_lab.conformance: head size 128 with 3 heads, odd token counts, batch 2, reference latents
at index 10, 20 or side by side): klein at degrees 1-2; detection; our key plan equals diffusers' converter at full
width; a LoRA on the fused qkv."""
from __future__ import annotations

import pytest
import torch

from family_support import FP32_TOL, assert_parity, at_worlds, relative_error
from sp_lab.conformance.cases import flux2_cases as make_cases
from sp_lab.references.flux2 import reference_forward as flux2_reference
from sp_runtime.families import flux, flux2, qwen_image21
from sp_runtime.checkpoints.header import read_checkpoint_header
from sp_lab.tiny_models import COMFY_PREFIX, build_tiny_model, write_tiny_checkpoint

pytest_plugins = ["family_pools"]  # the shared per-degree worker pools
SEED = 11
FILES = {"comfy_prefix": dict(prefix=COMFY_PREFIX), "klein": dict(variant="klein"),
         "diffusers": dict(layout="diffusers"), "diffusers_folder": dict(layout="diffusers_folder",
                                                                         max_shard_size="10MB")}


@pytest.fixture(scope="session")
def f2_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flux2")
    return {name: write_tiny_checkpoint("flux2", str(folder / name), seed=SEED, **kw) for name, kw in FILES.items()}


@pytest.fixture(scope="session")
def f2_references(family_subject):
    """Stock diffusers outputs from in-memory models: dev's are the conformance suite's (same seed and cases)."""
    klein = build_tiny_model("flux2", SEED, variant="klein")
    return {"dev": family_subject("flux2").outputs,
            "klein": {name: flux2_reference(klein, *case[:2], **case[2]) for name, case in make_cases().items()}}


@at_worlds(1, 2)
def test_klein_parity(family_pool, f2_files, f2_references):
    """klein (no guidance embedder) at degrees 1 and 2; the conformance suite runs dev's files."""
    handle = family_pool.load_model(f2_files["klein"])
    assert (handle.info.family, handle.info.variant) == ("flux2", "klein")
    for case, (x, t, inputs) in make_cases().items():
        assert_parity(handle(x, t, **inputs), f2_references["klein"][case], "float32", f"flux2_klein/{case}")
    handle.unload()


def test_references_guidance_and_placement_matter(f2_references):
    """Guards against a test that cannot fail."""
    dev, klein = f2_references["dev"], f2_references["klein"]
    assert relative_error(dev["two_refs_index"], dev["t2i"]) > 100 * FP32_TOL
    assert relative_error(dev["two_refs_index"], dev["refs_offset"]) > 100 * FP32_TOL
    model = build_tiny_model("flux2", SEED)
    x, t, inputs = make_cases()["t2i"]
    other = flux2_reference(model, x, t, **{**inputs, "guidance": torch.tensor([1.0, 1.0])})
    assert relative_error(other, dev["t2i"]) > 100 * FP32_TOL
    assert relative_error(klein["t2i"], dev["t2i"]) > 100 * FP32_TOL


def test_detection(f2_files):
    expected = {"comfy_prefix": ("original", COMFY_PREFIX, "dev"), "klein": ("original", "", "klein"),
                "diffusers": ("diffusers", "", "dev"), "diffusers_folder": ("diffusers", "", "dev")}
    for name, path in f2_files.items():
        header = read_checkpoint_header(path)
        detection = flux2.detect(header)
        assert (detection.layout, detection.prefix, detection.variant) == expected[name]
        assert detection.config["num_attention_heads"] == 3 and detection.config["attention_head_dim"] == 128
        assert detection.config["axes_dims_rope"] == (32, 32, 32, 32) and detection.config["mlp_ratio"] == 3.0
        assert flux.detect(header) is None and qwen_image21.detect(header) is None


@pytest.mark.parametrize("heads, double, single, guidance", [(48, 8, 48, True), (24, 5, 20, False),
                                                             (32, 8, 24, False)])
def test_real_size_headers(heads, double, single, guidance):
    """Flux.2 dev (48 x 128) and klein 4B / 9B (24 / 32 heads) read from header shapes alone."""
    width = heads * 128
    keys = {"img_in.weight": ("BF16", (width, 128)), "txt_in.weight": ("BF16", (width, 15360 if heads == 48 else
                                                                               3 * width)),
            "final_layer.linear.weight": ("BF16", (128, width))}
    for block in range(double):
        keys[f"double_blocks.{block}.img_attn.norm.key_norm.scale"] = ("BF16", (128,))
        keys[f"double_blocks.{block}.img_mlp.0.weight"] = ("BF16", (6 * width, width))
    for block in range(single):
        keys[f"single_blocks.{block}.linear1.weight"] = ("BF16", (3 * width + 6 * width, width))
    if guidance:
        keys["guidance_in.in_layer.weight"] = ("BF16", (width, 256))
    config = flux2.architecture(keys, "original")
    assert (config["num_attention_heads"], config["attention_head_dim"], config["num_layers"],
            config["num_single_layers"], config["mlp_ratio"], config["guidance_embeds"]) == (heads, 128, double,
                                                                                             single, 3.0, guidance)
    assert config["axes_dims_rope"] == (32, 32, 32, 32) and config["in_channels"] == 128


def test_key_plan_equals_diffusers_converter_at_full_width():
    """Flux.2 dev's fused tensors at the released width (6144), rows tagged by index (views: no real memory)."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers
    width = 6144

    def tagged(rows, columns):
        return torch.arange(rows, dtype=torch.float32)[:, None].expand(-1, columns)
    checkpoint = {"double_blocks.0.img_attn.qkv.weight": tagged(3 * width, width),
                  "double_blocks.0.txt_attn.norm.key_norm.scale": tagged(128, 1)[:, 0],
                  "single_blocks.7.linear1.weight": tagged(9 * width, width),
                  "final_layer.adaLN_modulation.1.weight": tagged(2 * width, width),
                  "double_stream_modulation_txt.lin.weight": tagged(6 * width, width)}
    want = convert_flux2_transformer_checkpoint_to_diffusers(dict(checkpoint))
    got = {}
    for source, targets in flux2.original_plan(checkpoint).items():
        for name, transform in targets:
            got[name] = transform(checkpoint[source])
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[name], want[name]) for name in want)


def test_lora_on_fused_qkv_splits_like_the_weight(f2_files, tmp_path):
    """A ComfyUI-named LoRA of a fused qkv reaches to_q, to_k, to_v (thirds of its rows) through the same plan."""
    from safetensors.torch import save_file
    from sp_runtime.lora.apply import LoraState
    path = f2_files["comfy_prefix"]
    model = flux2.load_model(path, "float32")[0]
    before = {name: value.clone() for name, value in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    width, rank, alpha, strength = 384, 4, 2.0, 0.7
    up, down = torch.randn(3 * width, rank, generator=g), torch.randn(rank, width, generator=g)
    stem = "diffusion_model.double_blocks.0.img_attn.qkv"
    lora = str(tmp_path / "qkv_lora.safetensors")
    save_file({f"{stem}.lora_B.weight": up, f"{stem}.lora_A.weight": down, f"{stem}.alpha": torch.tensor(alpha)},
              lora)
    state = LoraState(model, "flux2", path, torch.device("cpu"))
    assert state.set([[lora, strength]])["parameters"] == 3
    delta = strength * alpha / rank * (up @ down)
    after = model.state_dict()
    for third, name in enumerate(("to_q", "to_k", "to_v")):
        key = f"transformer_blocks.0.attn.{name}.weight"
        assert relative_error(after[key], before[key] + delta[third * width:(third + 1) * width]) <= 1e-6, key
    state.set([])
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
