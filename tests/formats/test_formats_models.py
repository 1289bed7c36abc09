"""Quantized checkpoints (ComfyUI scaled fp8, mixed precision per layer or in the metadata, GGUF) of Qwen-Image, Flux,
Wan and Z-Image (fused qkv split into q, k, v while quantized) under the pool at degrees 1-4: with weight_dtype fp32 the output equals diffusers on one process with the
dequantized weights (written independently by quant_files); by default the weights stay quantized (memory close to
the file's) and the output is within bf16 rounding of that; LoRA on quantized layers is exact and comes off
bitwise."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from family_support import assert_parity, at_worlds, relative_error
from sp_lab.references import reference_forward
from sp_lab.references.flux import reference_forward as flux_reference
from sp_lab.references.z_image import reference_forward as z_image_reference
from sp_lab.tiny_models.quant_files import FORMATS, write_quantized
from sp_runtime.families import flux, qwen_image, wan, z_image
from sp_runtime.checkpoints.header import read_header

pytest_plugins = ["family_pools"]
SEED = 5
WAN_HEAD = {"ulysses_sp.head_dim": "16"}
# family -> (module, tiny size for GGUF files: a 256-wide layer per block for the K-quants, load options)
FAMILIES = {
    "qwen_image": (qwen_image, dict(attention_head_dim=32, num_layers=3), {}),
    "flux": (flux, dict(attention_head_dim=32, num_layers=3), {}),
    "wan": (wan, dict(ffn_dim=256), {"head_dim": 16}),
    "z_image": (z_image, {}, {}),  # the tiny size has 256-wide layers (adaLN) already
}
# the degrees each test runs at (suite time): the degrees, fewer for families added later
DEGREES = {"fp32": (1, 4), "default": (2, 4)}  # fp32 at 2: the conformance suite's quantized-file check
FEWER_DEGREES = {"z_image": {"fp32": (4,), "default": (2,)}}


def make_case(family: str, seed: int = 1, bf16_timesteps: bool = False) -> tuple:
    """One ComfyUI call per family: batch 2, odd token counts (20 for the images, 45 for the video).
    bf16_timesteps: values bf16 holds exactly (diffusers rounds sigma to the compute dtype, ComfyUI and we do not)."""
    g = torch.Generator().manual_seed(seed)
    sigma = torch.tensor([0.5, 0.25] if bf16_timesteps else [0.7, 0.3])

    def rand(*shape):
        return torch.randn(*shape, generator=g)
    if family == "qwen_image":
        mask = torch.ones(2, 9, dtype=torch.long)
        mask[1, 6:] = 0
        return rand(2, 16, 1, 9, 7), sigma, {"context": rand(2, 9, 32), "attention_mask": mask}
    if family == "flux":
        return rand(2, 16, 9, 7), sigma, {"context": rand(2, 9, 32), "y": rand(2, 24),
                                                              "guidance": torch.tensor([3.5, 3.5])}
    if family == "z_image":
        return rand(2, 16, 9, 7), sigma, {"context": rand(2, 9, 32)}
    return rand(2, 16, 5, 6, 5), sigma * 1000, {"context": rand(2, 7, 32)}


@pytest.fixture(scope="session")
def quant_files(tmp_path_factory):
    """(family, format) -> (quantized file, float32 reference file, {key: quant type})."""
    folder = tmp_path_factory.mktemp("quantized")
    files = {}
    for family, (_, gguf_size, _) in FAMILIES.items():
        for fmt in FORMATS:
            path = str(folder / f"{family}_{fmt}.{'gguf' if fmt == 'gguf' else 'safetensors'}")
            reference = str(folder / f"{family}_{fmt}_reference.safetensors")
            size = gguf_size if fmt == "gguf" else {}
            prefix = "model.diffusion_model." if fmt == "scaled_fp8" else ""
            kinds = write_quantized(family, path, reference, fmt, SEED, prefix,
                                    WAN_HEAD if family == "wan" else None, **size)
            files[family, fmt] = (path, reference, kinds)
    return files


@pytest.fixture(scope="session")
def references(quant_files):
    """diffusers' stock forward on one process, on the dequantized weights: in float32, and in bf16 (the weights
    rounded to bf16, as the workers' per-layer dequantization rounds them)."""
    refs = {}
    for (family, fmt), (_, reference, _) in quant_files.items():
        module, _, options = FAMILIES[family]
        for dtype, bf16 in (("fp32", False), ("bf16", True)):
            model = module.load_model(reference, dtype, options=options)[0]
            x, t, inputs = make_case(family, bf16_timesteps=bf16)
            refs[family, fmt, dtype] = reference_forward(family)(model, x, t, **inputs)
    return refs


def _skip_degree(pool, family: str, test: str) -> None:
    """The shared pools cover degrees 1-4; these tests run at the degrees of DEGREES (suite time)."""
    wanted = FEWER_DEGREES.get(family, DEGREES)[test]
    if len(pool.config.devices) not in wanted:
        pytest.skip(f"runs at degrees {wanted}")


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_equals_the_dequantized_reference(family_pool, quant_files, references, family):
    _skip_degree(family_pool, family, "fp32")
    for fmt in FORMATS:
        path, _, _ = quant_files[family, fmt]
        handle = family_pool.load_model(path, "fp32", **FAMILIES[family][2])
        assert handle.info.weight_dtype == "float32" and handle.info.quant.startswith(("scaled_fp8", "comfy_quant",
                                                                                       "gguf"))
        x, t, inputs = make_case(family)
        assert_parity(handle(x, t, **inputs), references[family, fmt, "fp32"], "float32", f"quant_{fmt}/{family}")
        family_pool.unload(handle)


@pytest.mark.parametrize("family", FAMILIES)
def test_default_keeps_weights_quantized(family_pool, quant_files, references, family):
    _skip_degree(family_pool, family, "default")
    for fmt in FORMATS:
        path, _, kinds = quant_files[family, fmt]
        handle = family_pool.load_model(path, **FAMILIES[family][2])
        info = handle.info
        assert (info.weight_dtype, info.compute_dtype) == ("scaled_fp8" if fmt == "scaled_fp8" else
                                                           "gguf" if fmt == "gguf" else "comfy_quant", "bfloat16")
        assert info.weight_bytes <= 1.05 * _stored_bytes(path), (info.weight_bytes, _stored_bytes(path))
        assert set(info.quant_kernels) == _layer_formats(fmt, kinds), info.quant_kernels  # the load status
        x, t, inputs = make_case(family, bf16_timesteps=True)
        assert_parity(handle(x, t, **inputs), references[family, fmt, "bf16"], "bfloat16", f"quant_{fmt}/{family}")
        family_pool.unload(handle)


def _layer_formats(fmt: str, kinds: dict) -> set:
    """The layer formats the load status names for a file quant_files wrote."""
    if fmt == "scaled_fp8":
        return {"float8_e4m3fn", "float8_e4m3fn per-row"}
    return {f"gguf {kind}" for kind in kinds.values()} if fmt == "gguf" else set(kinds.values())


@pytest.mark.parametrize("only", ["int8_tensorwise convrot", "nvfp4", "mxfp8"])
def test_z_image_fused_qkv_splits_while_quantized(tmp_path, only):
    """Z-Image's fused qkv (int8 convrot in ComfyUI's released files; the block formats' scales come in tiles of 128
    rows) split into q, k, v that stay quantized, and the output equals that of the dequantized weights."""
    from sp_runtime.formats.weights import QuantLinear
    path, reference = str(tmp_path / "quantized.safetensors"), str(tmp_path / "reference.safetensors")
    kinds = write_quantized("z_image", path, reference, "comfy_quant", SEED, only=only)
    assert kinds["layers.0.attention.qkv.weight"] == kinds["layers.1.attention.qkv.weight"] == only
    model = z_image.load_model(path)[0]
    assert isinstance(model.layers[0].attention.to_k, QuantLinear)
    x, t, inputs = make_case("z_image", bf16_timesteps=True)
    expected = z_image_reference(z_image.load_model(reference, "bf16")[0], x, t, **inputs)
    assert_parity(z_image_reference(model, x, t, **inputs), expected, "bfloat16", f"quant_qkv_split/{only}")


def _stored_bytes(path: str) -> int:
    """Bytes of the tensors a file holds, biases and norms counted at bf16 (what the workers keep them in)."""
    sizes = {"F32": 2, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1}
    total = 0
    for kind, shape in read_header(path).tensors.values():
        numel = 1
        for size in shape:
            numel *= size
        if kind in sizes:
            total += numel * sizes[kind]
        else:  # GGUF blocks
            import gguf
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
            total += numel // block * type_size
    return total


# ---------------------------------------------------------------------------------------------------------------
# LoRA on quantized layers

LORA_MODULES = {  # original module -> rows of its output; the fused ones are split into several model weights
    "double_blocks.0.img_attn.qkv": 3 * 96, "single_blocks.1.linear1": 7 * 96, "double_blocks.1.img_mlp.2": 96,
    "txt_in": 96,  # not quantized: merged into a bf16 weight
}
DIFF_MODULE = "double_blocks.0.txt_mlp.0"  # a full difference on a quantized layer


def _write_lora(path: str, base: dict) -> dict:
    """A ComfyUI-named LoRA (rank 4, alpha 2) and the deltas it makes, in the original key space."""
    g = torch.Generator().manual_seed(9)
    tensors, deltas = {}, {}
    for module, rows in LORA_MODULES.items():
        cols = base[f"{module}.weight"].shape[1]
        up, down = torch.randn(rows, 4, generator=g) * 0.3, torch.randn(4, cols, generator=g) * 0.3
        tensors.update({f"diffusion_model.{module}.lora_B.weight": up, f"diffusion_model.{module}.lora_A.weight": down,
                        f"diffusion_model.{module}.alpha": torch.tensor(2.0)})
        deltas[f"{module}.weight"] = up @ down * 0.5
    diff = torch.randn(base[f"{DIFF_MODULE}.weight"].shape, generator=g) * 0.02
    tensors[f"diffusion_model.{DIFF_MODULE}.diff"] = diff
    deltas[f"{DIFF_MODULE}.weight"] = diff
    save_file(tensors, path)
    return deltas


def _patch_set():
    """ComfyUI weight patches on quantized layers (a LoRA at an offset into the fused qkv: low rank; a LoHa: a full
    difference; an OFT on a layer the LoRA file changes too: it needs the weight) and a diff on a bf16 layer."""
    from patch_reference import random_patch
    from sp_runtime.lora.patch_set import PatchSet, TargetPatches
    patches = {"double_blocks.0.img_attn.qkv.weight": ((288, 96), random_patch("lora", (96, 96), 1, strength=0.7,
                                                                                 alpha=2.0, offset=(0, 96, 96))),
               "double_blocks.1.img_mlp.2.weight": ((96, 384), random_patch("loha", (96, 384), 2, strength=-0.7)),
               "single_blocks.1.linear1.weight": ((672, 96), random_patch("oft", (672, 96), 3, strength=0.5)),
               "txt_in.weight": ((96, 32), random_patch("diff", (96, 32), 4, strength=1.0))}
    return PatchSet({key: TargetPatches(shape, (patch,)) for key, (shape, patch) in patches.items()})


@at_worlds(2)
def test_lora_on_quantized_layers_is_exact_and_comes_off_bitwise(plain_pool, quant_files, tmp_path):
    from patch_reference import reference
    path, reference_path, kinds = quant_files["flux", "comfy_quant"]
    assert {"double_blocks.0.img_attn.qkv.weight", "single_blocks.1.linear1.weight",
            "double_blocks.1.img_mlp.2.weight", DIFF_MODULE + ".weight"} <= set(kinds)
    base = load_file(reference_path)
    deltas = _write_lora(str(tmp_path / "lora.safetensors"), base)
    strength = 0.8
    merged = {key: value + strength * deltas[key] if key in deltas else value for key, value in base.items()}
    patches = _patch_set()
    patched_state = {**merged, **{key: reference(merged[key], target.patches)
                                  for key, target in patches.targets.items()}}
    save_file(merged, str(tmp_path / "merged.safetensors"))
    save_file(patched_state, str(tmp_path / "patched.safetensors"))
    references = {(name, dtype): flux.load_model(str(tmp_path / f"{name}.safetensors"), dtype)[0]
                  for name in ("merged", "patched") for dtype in ("fp32", "bf16")}
    for dtype, reference_dtype, tolerance in (("fp32", "fp32", "float32"), ("default", "bf16", "bfloat16")):
        x, t, inputs = make_case("flux", bf16_timesteps=reference_dtype == "bf16")
        handle = plain_pool.load_model(path, dtype)
        plain = handle(x, t, **inputs).clone()  # kept across later calls: a private copy
        handle.set_loras([[str(tmp_path / "lora.safetensors"), strength]])
        patched = handle(x, t, **inputs).clone()
        assert relative_error(patched, plain) > 1e-2  # the LoRA matters
        expected = flux_reference(references["merged", reference_dtype], x, t, **inputs)
        assert_parity(patched, expected, tolerance, f"quant_lora/{dtype}")
        handle.set_loras([[str(tmp_path / "lora.safetensors"), strength]], patches=patches)
        expected = flux_reference(references["patched", reference_dtype], x, t, **inputs)
        assert_parity(handle(x, t, **inputs), expected, tolerance, f"quant_patches/{dtype}")
        handle.set_loras([])
        assert torch.equal(handle(x, t, **inputs), plain)