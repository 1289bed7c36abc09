"""Mage-Flow beyond the conformance suite (sp_lab.conformance: the ComfyUI file with and without prefix, fp32 parity
at Ulysses 1-4, Ring, hybrid and CFG layouts, TP 2, quantized file, LoRA): the released sizes as ComfyUI's detection
reads them (and Qwen-Image's kept apart), the edit's references placed by index whatever the method says (as ComfyUI's
model), and the inputs it refuses by name."""
from __future__ import annotations

import pytest
import torch

from family_support import single_rank_output, single_rank_worker
from sp_lab.conformance.cases import mage_flow_cases
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint
from sp_runtime.checkpoints.header import Header
from sp_runtime.detection import detect as detect_any
from sp_runtime.families import mage_flow, qwen_image


def released_header(text_width: int, out_rows: int, name: str) -> Header:
    """The keys detection reads at the released sizes (3072 wide, 24 heads of 128, 12 blocks)."""
    keys = {"img_in.weight": (3072, 128), "txt_in.weight": (3072, text_width), "txt_norm.weight": (text_width,),
            "proj_out.weight": (out_rows, 3072)}
    for block in range(12):
        keys.update({f"transformer_blocks.{block}.attn.norm_q.weight": (128,),
                     f"transformer_blocks.{block}.img_mlp.net.0.proj.weight": (12288, 3072)})
    return Header(name, {COMFY_PREFIX + key: ("BF16", shape) for key, shape in keys.items()})


def test_released_header_and_qwen_image_apart():
    detection = detect_any(released_header(2560, 128, "mage_flow_turbo_int8_convrot.safetensors"))
    assert (detection.family, detection.variant) == ("mage_flow", "mage_flow")
    assert detection.config == {"patch_size": 1, "in_channels": 128, "out_channels": 128, "num_layers": 12,
                                "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 2560,
                                "axes_dims_rope": (16, 56, 56)}
    qwen = released_header(3584, 64, "qwen_image_fp8_e4m3fn.safetensors")
    assert detect_any(qwen).family == "qwen_image" and mage_flow.detect(qwen) is None
    assert qwen_image.detect(released_header(2560, 128, "mage_flow_edit_int8_convrot.safetensors")) is None
    assert mage_flow.COMFY.model_class(detection.variant) == "MageFlow"


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    path = write_tiny_checkpoint("mage_flow", str(tmp_path_factory.mktemp("mage") / "mage.safetensors"), seed=2,
                                 prefix=COMFY_PREFIX)
    return single_rank_worker(path)


def test_references_by_index_whatever_the_method(worker):
    """ComfyUI's Mage-Flow ignores ref_latents_method (references always at index 1 .. N): the output is the same
    under every method, and differs without the references (so the suite's edit case can fail)."""
    x, t, inputs = mage_flow_cases()["edit_two_refs"]
    by_index = single_rank_output(worker, x, t, inputs)
    for method in ("offset", "index_timestep_zero", "negative_index"):
        assert torch.equal(single_rank_output(worker, x, t, {**inputs, "ref_latents_method": method}), by_index)
    assert (single_rank_output(worker, x, t, {"context": inputs["context"]}) - by_index).abs().max() > 1e-3


def test_refusals_by_name(worker):
    x, t, inputs = mage_flow_cases()["3_tokens"]
    with pytest.raises(ValueError, match="control is not supported by the sequence-parallel Mage-Flow"):
        single_rank_output(worker, x, t, {**inputs, "control": {"input": [x]}})
    with pytest.raises(ValueError, match=r"ref_latents\[0\] has shape \(1, 16, 2, 2\)"):
        single_rank_output(worker, x, t, {**inputs, "ref_latents": [torch.zeros(1, 16, 2, 2)]})
    with pytest.raises(ValueError, match=r"x has shape \(1, 128, 1, 1, 3\)"):
        single_rank_output(worker, x[:, :, None], t, inputs)
    with pytest.raises(ValueError, match="needs context"):
        single_rank_output(worker, x, t, {})
