"""ERNIE-Image beyond the conformance suite (sp_lab.conformance: every file layout, fp32 parity at Ulysses 1-4, Ring,
hybrid, CFG and TP layouts, quantized file, LoRA): the released sizes as ComfyUI's ErnieImageModel fixes them, the key
layout diffusers' converter reads, neighbouring families' files, and the inputs the plan refuses by name."""
from __future__ import annotations

import pytest
import torch

from family_support import single_rank_worker
from sp_lab.conformance.cases import ernie_image_cases
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint
from sp_lab.tiny_models import ernie_image as tiny
from sp_runtime.checkpoints.header import Header
from sp_runtime.detection import detect as detect_any
from sp_runtime.families import ernie_image


def test_released_header_is_comfyuis_model():
    """ernie-image(-turbo).safetensors: 4096 wide (32 heads of 128), 36 blocks, a 3072-wide Ministral 3 text; ComfyUI
    builds ErnieImageModel with exactly these defaults (its detection reads no sizes)."""
    keys = {"x_embedder.proj.weight": (4096, 128, 1, 1), "text_proj.weight": (4096, 3072),
            "adaLN_modulation.1.weight": (6 * 4096, 4096), "final_linear.weight": (128, 4096)}
    for block in range(36):
        keys.update({f"layers.{block}.mlp.linear_fc2.weight": (4096, 12288),
                     f"layers.{block}.mlp.gate_proj.weight": (12288, 4096),
                     f"layers.{block}.self_attention.norm_q.weight": (128,)})
    detection = detect_any(Header("ernie-image-turbo.safetensors",
                                  {COMFY_PREFIX + key: ("BF16", shape) for key, shape in keys.items()}))
    assert detection.family == "ernie_image" and detection.layout == "original"
    assert detection.config == {"hidden_size": 4096, "num_attention_heads": 32, "num_layers": 36,
                                "ffn_hidden_size": 12288, "in_channels": 128, "out_channels": 128, "patch_size": 1,
                                "text_in_dim": 3072, "rope_theta": 256, "rope_axes_dim": (32, 48, 48), "eps": 1e-6,
                                "qk_layernorm": True}
    keys["layers.0.self_attention.norm_q.weight"] = (64,)
    with pytest.raises(ValueError, match="heads of 128"):
        detect_any(Header("ernie-odd.safetensors", {key: ("BF16", shape) for key, shape in keys.items()}))


def test_comfyui_names_are_diffusers_names():
    from diffusers.loaders.single_file_utils import convert_ernie_image_transformer_checkpoint_to_diffusers
    model = tiny.build_tiny_model(2)
    original = {COMFY_PREFIX + key: value for key, value in tiny.original_state_dict(model).items()}
    converted = convert_ernie_image_transformer_checkpoint_to_diffusers(dict(original))
    assert set(ernie_image.original_plan(converted)) == set(converted) == set(model.state_dict())


def test_neighbouring_files(tmp_path):
    """Z-Image and Lumina 2 also keep `layers.N`: their files stay theirs, ERNIE-Image's is ERNIE-Image's."""
    for family in ("z_image", "lumina2", "ernie_image"):
        path = write_tiny_checkpoint(family, str(tmp_path / f"{family}.safetensors"), seed=1)
        assert detect_any(path).family == family


def test_refused_inputs_are_named(tmp_path):
    path = write_tiny_checkpoint("ernie_image", str(tmp_path / "ernie.safetensors"), seed=1, prefix=COMFY_PREFIX)
    worker, context = single_rank_worker(path)
    x, t, inputs = ernie_image_cases()["batch_1"]
    out = torch.empty(x.shape)
    with pytest.raises(ValueError, match=r"context \[B, L, 40\]"):
        worker.forward(x, t, {}, out, context)
    with pytest.raises(ValueError, match=r"context \[B, L, 40\]"):
        worker.forward(x, t, {"context": inputs["context"][..., :8]}, out, context)
    with pytest.raises(ValueError, match=r"\[B, 128, H, W\]"):
        worker.forward(x[:, :16], t, inputs, out[:, :16], context)
