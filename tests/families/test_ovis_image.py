"""Ovis-Image beyond the conformance suite (sp_lab.conformance: every file layout, a reference by index, fp32 parity at
Ulysses 1-4, Ring, hybrid, CFG and TP layouts, quantized file, LoRA): the released sizes, how its
Flux-layout files are told from Flux.1's and LongCat-Image's, both key plans (ComfyUI's up / gate apart, diffusers'
fused), the split SwiGLU against diffusers' and fp8 storage of the split projections."""
from __future__ import annotations

import pytest
import torch
from diffusers.models.activations import SwiGLU

from sp_lab.references.ovis_image import reference_forward
from sp_lab.conformance.cases import ovis_image_cases
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint
from sp_lab.tiny_models import ovis_image as tiny
from sp_runtime.checkpoints.header import Header
from sp_runtime.detection import detect as detect_any
from sp_runtime.families import ovis_image
from sp_runtime.families.ovis_image.keys import diffusers_plan
from sp_runtime.families.ovis_image.loading import SwiGLUPair


def _released_keys(norm: str = "txt_norm.weight", **extra) -> dict:
    """ovis_image_bf16's shapes: 24 heads of 128, 6 double and 27 single blocks, Qwen3's 2048-wide text."""
    keys = {"img_in.weight": (3072, 64), "txt_in.weight": (3072, 2048), "time_in.in_layer.weight": (3072, 256),
            "final_layer.linear.weight": (64, 3072), norm: (2048,), **extra}
    for block in range(6):
        keys.update({f"double_blocks.{block}.img_attn.norm.key_norm.scale": (128,),
                     f"double_blocks.{block}.img_mlp.gate_proj.weight": (12288, 3072),
                     f"double_blocks.{block}.img_mlp.up_proj.weight": (12288, 3072)})
    for block in range(27):
        keys[f"single_blocks.{block}.linear1.weight"] = (33792, 3072)
    return {COMFY_PREFIX + key: ("BF16", shape) for key, shape in keys.items()}


def test_released_header_and_other_swiglu_files():
    for norm in ("txt_norm.weight", "txt_norm.scale"):
        detection = detect_any(Header("ovis_image_bf16.safetensors", _released_keys(norm)))
        assert (detection.family, detection.layout) == ("ovis_image", "original")
        assert detection.config == {"patch_size": 1, "in_channels": 64, "out_channels": 64, "num_layers": 6,
                                    "num_single_layers": 27, "attention_head_dim": 128, "num_attention_heads": 24,
                                    "joint_attention_dim": 2048, "axes_dims_rope": (16, 56, 56)}
    for keys in (_released_keys("other.weight"), _released_keys(**{"vector_in.in_layer.weight": (3072, 768)})):
        with pytest.raises(ValueError, match="SwiGLU MLPs but not Ovis-Image's inputs"):
            ovis_image.detect(Header("other.safetensors", keys))
    wide = {**_released_keys(), COMFY_PREFIX + "single_blocks.0.linear1.weight": ("BF16", (21504, 3072))}
    with pytest.raises(ValueError, match="21504 fused single-block rows"):
        ovis_image.detect(Header("other.safetensors", wide))


def test_flux_longcat_and_ovis_files_are_told_apart(tmp_path):
    for family in ("flux", "longcat_image", "ovis_image"):
        for layout in ("original", "diffusers"):
            path = write_tiny_checkpoint(family, str(tmp_path / f"{family}_{layout}.safetensors"), seed=1,
                                         layout=layout)
            assert detect_any(path).family == family


def _split_state(model) -> dict[str, torch.Tensor]:
    """The tiny diffusers model's weights as the loader's model names them (SwiGLU up / gate apart)."""
    state = {}
    for key, value in model.state_dict().items():
        if ".net.0.proj." in key and key.startswith("transformer_blocks."):
            up, gate = value.chunk(2)
            state[key.replace(".proj.", ".up_proj.")], state[key.replace(".proj.", ".gate_proj.")] = up, gate
        elif ".proj_mlp." in key:
            up, gate = value.chunk(2)
            state[key.replace(".proj_mlp.", ".proj_mlp.up_proj.")] = up
            state[key.replace(".proj_mlp.", ".proj_mlp.gate_proj.")] = gate
        else:
            state[key] = value
    return state


@pytest.mark.parametrize("layout", ["original", "diffusers"])
def test_key_plans_round_trip(layout):
    model = tiny.build_tiny_model(3)
    source = tiny.original_state_dict(model) if layout == "original" else model.state_dict()
    plan = (ovis_image.original_plan if layout == "original" else diffusers_plan)(source, tiny.tiny_config())
    ours = {target: (transform or (lambda tensor: tensor))(source[key]) for key in source
            for target, transform in plan[key]}
    expected = _split_state(model)
    assert set(ours) == set(expected)
    assert all(torch.equal(ours[key], value) for key, value in expected.items())


def test_split_swiglu_is_diffusers_swiglu():
    fused = SwiGLU(12, 20)
    torch.nn.init.normal_(fused.proj.bias)
    pair = SwiGLUPair(fused.proj)
    up, gate = fused.proj.weight.chunk(2)
    up_bias, gate_bias = fused.proj.bias.chunk(2)
    pair.load_state_dict({"up_proj.weight": up, "gate_proj.weight": gate, "up_proj.bias": up_bias,
                          "gate_proj.bias": gate_bias})
    x = torch.randn(2, 5, 12)
    assert torch.allclose(pair(x), fused(x), atol=1e-6)


def test_fp8_file_casts_the_split_projections(tmp_path):
    """fp8 storage: diffusers' layerwise casting reaches the projections the loader adds; the text norm takes
    ComfyUI's epsilon (its dtype's)."""
    path = write_tiny_checkpoint("ovis_image", str(tmp_path / "ovis_fp8.safetensors"), dtype="float8_e4m3fn",
                                 seed=2, prefix=COMFY_PREFIX)
    model, _, dtypes = ovis_image.load_model(path)
    assert dtypes.layerwise and model.transformer_blocks[0].ff.net[0].gate_proj.weight.dtype == torch.float8_e4m3fn
    assert model.context_embedder_norm.eps is None
    fp32, _, _ = ovis_image.load_model(path, "float32")
    x, t, inputs = ovis_image_cases()["batch_1"]
    expected = reference_forward(fp32, x, t, **inputs)
    assert (reference_forward(model, x, t, **inputs) - expected).abs().max() < 0.05 * expected.abs().max()


def test_loras_on_the_fused_linear1_and_a_swiglu_half(tmp_path):
    """A ComfyUI-named LoRA on single_blocks.1.linear1 (q, k, v, up, gate rows) and on double_blocks.0's
    txt_mlp.gate_proj reaches the loader's parameters row by row; [] gives the weights back."""
    from safetensors.torch import save_file
    from sp_runtime.lora.apply import LoraState
    path = write_tiny_checkpoint("ovis_image", str(tmp_path / "ovis.safetensors"), seed=4, prefix=COMFY_PREFIX)
    model = ovis_image.load_model(path, "float32")[0]
    before = {name: value.clone() for name, value in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    width, rank, alpha, strength = 96, 4, 2.0, 0.7
    fused = {"single_blocks.1.linear1": 11 * width, "double_blocks.0.txt_mlp.gate_proj": 4 * width}
    tensors, deltas = {}, {}
    for stem, rows in fused.items():
        up, down = torch.randn(rows, rank, generator=g), torch.randn(rank, width, generator=g)
        tensors.update({f"diffusion_model.{stem}.lora_B.weight": up, f"diffusion_model.{stem}.lora_A.weight": down,
                        f"diffusion_model.{stem}.alpha": torch.tensor(alpha)})
        deltas[stem] = strength * alpha / rank * (up @ down)
    lora = str(tmp_path / "lora.safetensors")
    save_file(tensors, lora)
    state = LoraState(model, "ovis_image", path, torch.device("cpu"))
    assert state.set([[lora, strength]])["parameters"] == 6
    after = model.state_dict()
    rows = {"attn.to_q": 0, "attn.to_k": 1, "attn.to_v": 2, "proj_mlp.up_proj": 3, "proj_mlp.gate_proj": 7}
    for name, start in rows.items():
        count = width if name.startswith("attn") else 4 * width
        key = f"single_transformer_blocks.1.{name}.weight"
        want = before[key] + deltas["single_blocks.1.linear1"][start * width:start * width + count]
        assert (after[key] - want).abs().max() <= 1e-5, key
    key = "transformer_blocks.0.ff_context.net.0.gate_proj.weight"
    assert (after[key] - before[key] - deltas["double_blocks.0.txt_mlp.gate_proj"]).abs().max() <= 1e-5
    state.set([])
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
