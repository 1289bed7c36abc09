"""Wan 2.2 S2V and Animate from quantized files (ComfyUI mixed precision `.comfy_quant`, ComfyUI scaled fp8 as the
S2V template's `wan2.2_s2v_14B_fp8_scaled`, GGUF), their extra modules quantized too (audio encoder and injector,
face adapter, face and motion encoders): with weight_dtype fp32 the pool equals a single-process run on the
dequantized weights (written independently by quant_files) within 1e-5; kept quantized (default), within bf16
rounding of it. A LoRA on the extra modules (on quantized layers, a fused face-adapter kv, a motion-encoder layer the
loader dequantizes) equals the merged weights' run and comes off bitwise. 3 heads of 128, batch 2, degrees 2-4."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from family_support import assert_parity, relative_error
from sp_lab.references.wan import reference_forward
from sp_runtime.families import wan
from sp_lab.tiny_models.quant_files import write_quantized
from test_wan_animate import make_cases as animate_cases
from test_wan_s2v import make_cases as s2v_cases

pytest_plugins = ["family_pools"]  # the shared per-degree worker pools

SIZE = dict(num_attention_heads=3, attention_head_dim=128)  # 3 heads: 2 and 4 ranks do not divide them
HEAD = {"ulysses_sp.head_dim": "128"}
# variant -> (formats written, those also run kept quantized, the case of the variant's own test module that is run);
# Animate's face video goes through the real-size motion encoder (512 x 512 pixels): fewer runs (suite time)
VARIANTS = {"s2v": (("comfy_quant", "scaled_fp8", "gguf"), ("comfy_quant", "scaled_fp8", "gguf"),
                    lambda: s2v_cases()["everything"]),
            "animate": (("comfy_quant", "gguf"), ("comfy_quant",), lambda: animate_cases()["face_and_pose_padded"])}
# variant -> {LoRA module (ComfyUI's name): rows of the weight it changes}
LORA_MODULES = {
    "s2v": {"audio_injector.injector.1.q": 384, "audio_injector.injector_adain_layers.0.linear": 768,
            "casual_audio_encoder.encoder.final_linear": 384, "blocks.0.self_attn.o": 384},
    "animate": {"face_adapter.fuser_blocks.0.linear1_kv": 768, "face_encoder.out_proj": 384,
                "motion_encoder.enc.fc.1": 512, "blocks.1.cross_attn.k_img": 384},
}
LORA_STRENGTH = 0.7


def call(variant: str, bf16_timesteps: bool = False) -> tuple:
    """The variant's case; bf16_timesteps: values bf16 holds exactly (diffusers rounds sigma to the compute dtype)."""
    x, t, inputs = VARIANTS[variant][2]()
    return x, torch.tensor([500.0, 250.0]) if bf16_timesteps else t, inputs


@pytest.fixture(scope="session")
def quant_files(tmp_path_factory):
    """(variant, format) -> (quantized file, float32 file of the weights it encodes, {key: quant type})."""
    folder = tmp_path_factory.mktemp("wan_variants_quant")
    files = {}
    for variant, (formats, *_) in VARIANTS.items():
        for seed, fmt in enumerate(formats):
            path = str(folder / f"{variant}_{fmt}.{'gguf' if fmt == 'gguf' else 'safetensors'}")
            reference = str(folder / f"{variant}_{fmt}_reference.safetensors")
            prefix = "model.diffusion_model." if fmt == "scaled_fp8" else ""
            kinds = write_quantized("wan", path, reference, fmt, seed, prefix, HEAD, variant=variant, **SIZE)
            files[variant, fmt] = (path, reference, kinds)
    return files


@pytest.fixture(scope="session")
def references(quant_files):
    """Single-process runs on the dequantized weights: fp32, and bf16 (weights rounded as the workers' per-layer
    dequantization rounds them)."""
    refs = {}
    for (variant, fmt), (_, reference, _) in quant_files.items():
        for dtype, bf16 in (("fp32", False), ("bf16", True)):
            if bf16 and fmt not in VARIANTS[variant][1]:
                continue
            x, t, inputs = call(variant, bf16)
            refs[variant, fmt, dtype] = reference_forward(wan.load_model(reference, dtype)[0], x, t, **inputs)
    return refs


def test_the_extra_modules_are_quantized(quant_files):
    for (variant, fmt), (_, _, kinds) in quant_files.items():
        modules = {key.split(".", 1)[0] for key in kinds}
        expected = {"s2v": {"audio_injector", "casual_audio_encoder"},
                    "animate": {"face_adapter", "face_encoder", "motion_encoder"}}[variant]
        assert expected <= modules, (variant, fmt, modules)


@pytest.mark.parametrize("family_pool", [3], indirect=True)  # one degree each (suite time)
@pytest.mark.parametrize("variant", VARIANTS)
def test_fp32_equals_the_dequantized_reference(family_pool, quant_files, references, variant):
    for fmt in VARIANTS[variant][0]:
        handle = family_pool.load_model(quant_files[variant, fmt][0], "fp32")
        assert handle.info.variant == variant and handle.info.weight_dtype == "float32"
        x, t, inputs = call(variant)
        assert_parity(handle(x, t, **inputs), references[variant, fmt, "fp32"], "float32", f"quant_{fmt}/{variant}")
        family_pool.unload(handle)


@pytest.mark.parametrize("family_pool", [2], indirect=True)  # one degree each (suite time)
@pytest.mark.parametrize("variant", VARIANTS)
def test_default_keeps_weights_quantized(family_pool, quant_files, references, variant):
    for fmt in VARIANTS[variant][1]:
        handle = family_pool.load_model(quant_files[variant, fmt][0])
        assert handle.info.compute_dtype == "bfloat16" and handle.info.weight_dtype in ("comfy_quant", "scaled_fp8",
                                                                                        "gguf")
        x, t, inputs = call(variant, bf16_timesteps=True)
        assert_parity(handle(x, t, **inputs), references[variant, fmt, "bf16"], "bfloat16",
                      f"quant_{fmt}/{variant}")
        family_pool.unload(handle)


def write_lora(path: str, variant: str, base: dict, seed: int = 3) -> dict:
    """A ComfyUI-named LoRA (rank 4, alpha 2) on the variant's modules; returns the deltas in the file's key space."""
    g = torch.Generator().manual_seed(seed)
    tensors, deltas = {}, {}
    for module, rows in LORA_MODULES[variant].items():
        columns = base[f"{module}.weight"].shape[1]
        assert base[f"{module}.weight"].shape[0] == rows
        up, down = torch.randn(rows, 4, generator=g) * 0.3, torch.randn(4, columns, generator=g) * 0.3
        tensors.update({f"diffusion_model.{module}.lora_B.weight": up, f"diffusion_model.{module}.lora_A.weight": down,
                        f"diffusion_model.{module}.alpha": torch.tensor(2.0)})
        deltas[f"{module}.weight"] = up @ down * 0.5
    save_file(tensors, path)
    return deltas


@pytest.mark.parametrize("family_pool", [4], indirect=True)  # one degree each (suite time)
@pytest.mark.parametrize("variant", VARIANTS)
def test_lora_on_the_extra_modules_of_a_quantized_model(family_pool, quant_files, variant, tmp_path):
    path, reference_path, kinds = quant_files[variant, "comfy_quant"]
    base = load_file(reference_path)
    lora = str(tmp_path / "lora.safetensors")
    deltas = write_lora(lora, variant, base)
    assert len([key for key in deltas if key in kinds]) >= 3  # on quantized layers (and a fused one: Animate's kv)
    merged = {key: value + LORA_STRENGTH * deltas.get(key, 0) for key, value in base.items()}
    save_file(merged, str(tmp_path / "merged.safetensors"), metadata=HEAD)
    handle = family_pool.load_model(path, "fp32")
    x, t, inputs = call(variant)
    plain = handle(x, t, **inputs).clone()  # kept across later calls: a private copy
    summary = handle.set_loras([[lora, LORA_STRENGTH]])
    assert not summary.get("skipped"), summary
    patched = handle(x, t, **inputs).clone()
    assert relative_error(patched, plain) > 1e-3  # the LoRA matters
    expected = reference_forward(wan.load_model(str(tmp_path / "merged.safetensors"), "fp32")[0], x, t, **inputs)
    assert_parity(patched, expected, "float32", f"quant_lora/{variant}")
    handle.set_loras([])
    assert handle(x, t, **inputs).equal(plain)
    family_pool.unload(handle)
