"""Lens beyond the conformance suite (sp_lab.conformance: the ComfyUI file, fp32 parity at Ulysses 1-4, Ring, hybrid
and CFG layouts, TP 2, quantized file, LoRA): the released sizes as ComfyUI's detection reads them (Qwen-Image and
Mage-Flow kept apart), the variants refused by name, the key plan's split of the fused q / k / v."""
from __future__ import annotations

import pytest
import torch

from sp_lab.tiny_models import COMFY_PREFIX
from sp_runtime.checkpoints.header import Header
from sp_runtime.detection import detect as detect_any
from sp_runtime.families import lens, mage_flow, qwen_image


def released_header(drop: str = "", name: str = "lens_bf16.safetensors") -> Header:
    """The keys detection reads at the released sizes (1536 wide, 24 heads of 64, 48 blocks, 4 text layers of 2880,
    Flux.2's 128-channel latent)."""
    keys = {"img_in.weight": (1536, 128), "txt_in.weight": (1536, 4 * 2880), "proj_out.weight": (128, 1536),
            **{f"txt_norm.{layer}.weight": (2880,) for layer in range(4)}}
    for block in range(48):
        keys.update({f"transformer_blocks.{block}.attn.norm_q.weight": (64,),
                     f"transformer_blocks.{block}.attn.img_qkv.weight": (3 * 1536, 1536),
                     f"transformer_blocks.{block}.img_norm1.weight": (1536,),
                     f"transformer_blocks.{block}.img_mlp.w1.weight": (4096, 1536)})
    keys = {key: shape for key, shape in keys.items() if not drop or not key.startswith(drop)}
    return Header(name, {COMFY_PREFIX + key: ("BF16", shape) for key, shape in keys.items()})


def test_released_header_and_neighbours_apart():
    detection = detect_any(released_header())
    assert (detection.family, detection.layout, detection.prefix) == ("lens", "original", COMFY_PREFIX)
    assert detection.config == {"patch_size": 1, "in_channels": 128, "out_channels": 128, "num_layers": 48,
                                "attention_head_dim": 64, "num_attention_heads": 24, "joint_attention_dim": 4 * 2880,
                                "axes_dims_rope": (8, 28, 28), "text_layers": 4, "mlp_width": 4096}
    assert qwen_image.detect(released_header()) is None and mage_flow.detect(released_header()) is None
    assert lens.COMFY.model_class(detection.variant) == "Lens"


@pytest.mark.parametrize("drop", ["txt_norm.", "transformer_blocks.0.img_norm1."])
def test_other_variants_are_refused_by_name(drop):
    header = released_header(drop)
    if drop == "txt_norm.":  # a single text layer, as ComfyUI's multi_layer_encoder_feature=False
        header.tensors[COMFY_PREFIX + "txt_norm.weight"] = ("BF16", (2880,))
    with pytest.raises(ValueError, match="Lens file with a single text layer"):
        detect_any(header)


def test_fused_qkv_rows_go_to_diffusers_projections():
    config = lens.detect(released_header()).config
    plan = lens.original_plan(["transformer_blocks.3.attn.txt_qkv.bias", "transformer_blocks.3.img_mlp.w2.weight"],
                              config)
    fused = torch.arange(3 * 1536.0)
    targets = plan["transformer_blocks.3.attn.txt_qkv.bias"]
    assert [name for name, _ in targets] == [f"transformer_blocks.3.attn.add_{p}_proj.bias" for p in "qkv"]
    for number, (_, rows) in enumerate(targets):
        assert torch.equal(rows(fused), fused[number * 1536:(number + 1) * 1536])
    assert plan["transformer_blocks.3.img_mlp.w2.weight"] == [("transformer_blocks.3.img_mlp.w2.weight", None)]
