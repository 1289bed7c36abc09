"""The quantized formats' dequantizers and header detection, against hand-built blocks and independent references:
GGUF (every type against gguf's numpy dequantizer; Q8_0 and Q4_K blocks built by hand), ComfyUI's swizzled block
scales, nvfp4 nibble order, mxfp8 exponents, the convrot rotation; real-width scaled-fp8 headers detected alone."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from sp_runtime.formats import comfy_quant
from sp_runtime.formats.weights import QuantWeight


def _gguf_weight(raw: np.ndarray, kind: str, shape) -> QuantWeight:
    return QuantWeight("gguf", tuple(shape), {"blocks": torch.from_numpy(raw.copy()).reshape(shape[0], -1)},
                       params={"type": kind})


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                                  "IQ4_NL", "IQ4_XS", "BF16"])
def test_gguf_dequantizers_equal_ggufs_reference(kind):
    import gguf
    from sp_lab.tiny_models.quant_files import K_SCALE_FIELDS, _random_k_blocks
    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    shape = (3, 2 * max(block, 256))
    if kind in K_SCALE_FIELDS:
        raw = _random_k_blocks(shape, kind, np.random.default_rng(1))
    elif kind == "BF16":
        raw = gguf.quants.quantize(np.random.default_rng(1).standard_normal(shape).astype(np.float32), qtype)
    else:
        raw = gguf.quants.quantize(np.random.default_rng(1).standard_normal(shape).astype(np.float32), qtype) \
            if kind not in ("IQ4_NL", "IQ4_XS") else _finite_random_blocks(shape, block, size)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32)).reshape(shape)
    got = _gguf_weight(raw.view(np.uint8), kind, shape).dequantize(torch.float32)
    assert torch.equal(got, expected)


def _finite_random_blocks(shape, block, size) -> np.ndarray:
    """Random blocks whose leading fp16 scale is a sane value (IQ4 types have it first)."""
    raw = np.random.default_rng(2).integers(0, 256, size=(shape[0], shape[1] // block, size), dtype=np.uint8)
    raw[..., 0:2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    return raw.reshape(shape[0], -1)


def test_q8_0_block_built_by_hand():
    """Q8_0: fp16 scale d, then 32 int8 codes; w = d x q."""
    codes = np.arange(-16, 16, dtype=np.int8)
    raw = np.frombuffer(np.float16(0.25).tobytes() + codes.tobytes(), dtype=np.uint8)[None]
    got = _gguf_weight(raw, "Q8_0", (1, 32)).dequantize()
    assert torch.equal(got, torch.from_numpy(codes.astype(np.float32) * 0.25)[None])


def test_q4_k_block_built_by_hand():
    """Q4_K (ggml's block_q4_K): fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks of 32,
    then 128 bytes of 4-bit codes: 64-element chunk i takes the low nibbles of bytes 32i..32i+31 (sub-block 2i) and
    then their high nibbles (sub-block 2i+1). w = d x scale_j x q - dmin x min_j."""
    d, dmin = 0.5, 0.25
    scales, mins = list(range(1, 9)), [2 * j for j in range(8)]  # all < 16: the packed high bits stay 0
    packed = bytearray(12)
    for j in range(4):
        packed[j], packed[j + 4] = scales[j], mins[j]
    for j in range(4, 8):
        packed[j + 4] = scales[j] | (mins[j] << 4)
    element_codes = np.arange(256) % 16
    qs = bytearray(128)
    for chunk in range(4):
        for byte in range(32):
            low, high = element_codes[64 * chunk + byte], element_codes[64 * chunk + 32 + byte]
            qs[32 * chunk + byte] = low | (high << 4)
    raw = np.frombuffer(struct.pack("<ee", d, dmin) + bytes(packed) + bytes(qs), dtype=np.uint8)[None]
    expected = [d * scales[e // 32] * element_codes[e] - dmin * mins[e // 32] for e in range(256)]
    got = _gguf_weight(raw, "Q4_K", (1, 256)).dequantize()
    assert torch.equal(got, torch.tensor(expected, dtype=torch.float32)[None])


def test_unswizzle_reads_cublas_tiles():
    """Element (r, c) of a [rows, cols] scale matrix sits at ((r // 128 * tiles_across + c // 4) * 32 + r % 32) * 16
    + (r // 32 % 4) * 4 + c % 4 of the swizzled storage (tiles padded to 128 x 4)."""
    rows, cols = 130, 5
    across = 2
    storage = torch.full((256 * 8,), -1, dtype=torch.int32)
    for r in range(rows):
        for c in range(cols):
            storage[((r // 128 * across + c // 4) * 32 + r % 32) * 16 + (r // 32 % 4) * 4 + c % 4] = r * 100 + c
    expected = torch.tensor([[r * 100 + c for c in range(cols)] for r in range(rows)], dtype=torch.int32)
    assert torch.equal(comfy_quant.unswizzle(storage.reshape(256, 8), rows, cols), expected)


def test_nvfp4_even_element_in_the_high_nibble():
    """Byte 0x2F holds element 0 = code 2 (1.0) and element 1 = code 15 (-6.0); w = e2m1 x block scale x scale_2."""
    packed = torch.tensor([[0x2F] + [0x00] * 7], dtype=torch.uint8)  # one row of 16 elements
    block_scale = torch.zeros(128, 4, dtype=torch.float8_e4m3fn)
    block_scale[0, 0] = 2.0  # row 0, block 0: the first swizzled element
    weight = comfy_quant._nvfp4(packed, {"scale": block_scale, "scale_2": torch.tensor(0.5)})
    expected = torch.zeros(1, 16)
    expected[0, :2] = torch.tensor([1.0, -6.0])
    assert torch.equal(weight.dequantize(), expected)


def test_mxfp8_scales_are_powers_of_two_with_bias_127():
    codes = torch.full((1, 64), 1.5).to(torch.float8_e4m3fn)
    scales = torch.zeros(128, 4, dtype=torch.uint8)
    scales[0, 0], scales[0, 1] = 127 + 3, 127 - 2  # the row's two blocks of 32
    weight = comfy_quant._mxfp8(codes, {"scale": scales.view(torch.float8_e8m0fnu)})
    expected = torch.cat([torch.full((32,), 1.5 * 8), torch.full((32,), 1.5 / 4)])[None]
    assert torch.equal(weight.dequantize(), expected)


def test_convrot_rotation_is_the_issue_s_regular_hadamard():
    h4 = torch.tensor([[1.0, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]])
    h16 = torch.kron(h4, h4) / 4
    assert torch.equal(comfy_quant.regular_hadamard(16, "cpu"), h16)
    assert torch.allclose(h16 @ h16, torch.eye(16), atol=1e-6)  # symmetric and orthogonal: its own inverse
    codes = torch.randint(-127, 128, (3, 32), dtype=torch.int8)
    scale = torch.rand(3, 1) + 0.5
    weight = comfy_quant.scaled_weight(codes, scale, rotation_group=16)
    expected = ((codes.float() * scale).reshape(3, 2, 16) @ h16).reshape(3, 32)
    assert torch.allclose(weight.dequantize(), expected, atol=1e-6)
    with pytest.raises(ValueError, match="groups of 64"):
        comfy_quant.scaled_weight(codes, scale, rotation_group=64)


# ---------------------------------------------------------------------------------------------------------------
# Real-width headers, detected alone (sparse files: the weights are never read)

def _sparse_checkpoint(path, tensors: dict, small: dict | None = None, metadata: dict | None = None) -> None:
    """A safetensors file whose header lists `tensors` (name -> (dtype, shape)) over a hole of zeros; `small`
    tensors (name -> bytes) are written for real."""
    sizes = {"F8_E4M3": 1, "BF16": 2, "F32": 4, "U8": 1}
    header, offset, payload = {}, 0, []
    for name, (dtype, shape) in tensors.items():
        data = (small or {}).get(name)
        length = len(data) if data is not None else int(np.prod(shape)) * sizes[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + length]}
        payload.append((offset, data))
        offset += length
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(text)) + text)
        for start, data in payload:
            if data is not None:
                handle.seek(8 + len(text) + start)
                handle.write(data)
        handle.truncate(8 + len(text) + offset)


def _scaled(tensors: dict, prefix: str) -> dict:
    """Every 2-D block weight as fp8 with a per-tensor scale, the rest bf16 / fp32; plus the scaled_fp8 marker."""
    out = {}
    for name, shape in tensors.items():
        if "blocks." in name and name.endswith(".weight") and len(shape) == 2:
            out[prefix + name] = ("F8_E4M3", shape)
            out[prefix + name[: -len(".weight")] + ".scale_weight"] = ("F32", ())
        else:
            out[prefix + name] = ("BF16" if len(shape) > 1 else "F32", shape)
    out[prefix + "scaled_fp8"] = ("F8_E4M3", (0,))
    return out


def _wan_22_14b_block(width=5120, ffn=13824, text=4096) -> dict:
    shapes = {"patch_embedding.weight": (width, 36, 1, 2, 2), "patch_embedding.bias": (width,),
              "text_embedding.0.weight": (width, text), "text_embedding.0.bias": (width,),
              "text_embedding.2.weight": (width, width), "text_embedding.2.bias": (width,),
              "time_embedding.0.weight": (width, 256), "time_embedding.0.bias": (width,),
              "time_embedding.2.weight": (width, width), "time_embedding.2.bias": (width,),
              "time_projection.1.weight": (6 * width, width), "time_projection.1.bias": (6 * width,),
              "head.head.weight": (64, width), "head.head.bias": (64,), "head.modulation": (1, 2, width),
              "blocks.0.modulation": (1, 6, width), "blocks.0.norm3.weight": (width,), "blocks.0.norm3.bias": (width,),
              "blocks.0.ffn.0.weight": (ffn, width), "blocks.0.ffn.0.bias": (ffn,),
              "blocks.0.ffn.2.weight": (width, ffn), "blocks.0.ffn.2.bias": (width,)}
    for attn in ("self_attn", "cross_attn"):
        for part in "qkvo":
            shapes[f"blocks.0.{attn}.{part}.weight"] = (width, width)
            shapes[f"blocks.0.{attn}.{part}.bias"] = (width,)
        shapes[f"blocks.0.{attn}.norm_q.weight"] = (width,)
        shapes[f"blocks.0.{attn}.norm_k.weight"] = (width,)
    return shapes


def _state_shapes(model) -> dict:
    return {key: tuple(value.shape) for key, value in model.state_dict().items()}


def test_real_width_scaled_fp8_headers_are_detected_alone(tmp_path):
    """Wan 2.2 I2V A14B (one block), Qwen-Image and Flux (width 3072, one block each) as ComfyUI fp8_scaled files."""
    from accelerate import init_empty_weights
    from diffusers import FluxTransformer2DModel, QwenImageTransformer2DModel

    from sp_runtime.detection import detect
    from sp_lab.tiny_models import _flux_to_original

    wan_path = tmp_path / "wan2.2_i2v_high_noise_14B_fp8_scaled.safetensors"
    _sparse_checkpoint(wan_path, _scaled(_wan_22_14b_block(), "model.diffusion_model."))
    with init_empty_weights():
        qwen = QwenImageTransformer2DModel(num_layers=1)
        flux_model = FluxTransformer2DModel(num_layers=1, num_single_layers=1, guidance_embeds=True)
    qwen_path, flux_path = tmp_path / "qwen_image_fp8_scaled.safetensors", tmp_path / "flux_fp8_scaled.safetensors"
    _sparse_checkpoint(qwen_path, _scaled(_state_shapes(qwen), ""))
    flux_shapes = {k: tuple(v.shape) for k, v in _flux_to_original(flux_model.state_dict(), 1, 1).items()}
    _sparse_checkpoint(flux_path, _scaled(flux_shapes, "model.diffusion_model."))

    wan_found = detect(str(wan_path))
    assert (wan_found.family, wan_found.variant, wan_found.config["num_layers"]) == ("wan", "i2v_concat", 1)
    assert wan_found.quant == "scaled_fp8 (scaled fp8 x 10)"  # 8 attention + 2 feed-forward
    qwen_found = detect(str(qwen_path))
    assert (qwen_found.family, qwen_found.variant, qwen_found.config["num_attention_heads"]) == ("qwen_image",
                                                                                                  "image", 24)
    assert qwen_found.quant.startswith("scaled_fp8 (scaled fp8 x ")
    flux_found = detect(str(flux_path))
    assert (flux_found.family, flux_found.variant, flux_found.config["num_attention_heads"]) == ("flux", "dev", 24)
    assert flux_found.quant.startswith("scaled_fp8")


def test_unsupported_quant_types_are_named(tmp_path):
    from sp_runtime.detection import detect
    path = tmp_path / "w4a4.safetensors"
    tensors = _scaled(_wan_22_14b_block(width=256, ffn=512, text=64), "")
    del tensors["scaled_fp8"]
    entry = json.dumps({"format": "convrot_w4a4"}).encode()
    tensors["blocks.0.ffn.0.comfy_quant"] = ("U8", (len(entry),))
    _sparse_checkpoint(path, tensors, small={"blocks.0.ffn.0.comfy_quant": entry})
    with pytest.raises(ValueError, match="'convrot_w4a4', which is not supported; supported ComfyUI formats"):
        detect(str(path))
