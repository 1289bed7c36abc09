"""Krea 2 beyond the conformance suite (sp_lab.conformance: every file layout, fp32 parity at Ulysses 1-4, Ring,
hybrid and CFG layouts, quantized file, LoRA): the key plan against diffusers' converter, the released sizes as
ComfyUI's detection reads them, and reference latents (the style-reference workflow) used only with a method."""
from __future__ import annotations

import pytest
import torch

from family_support import single_rank_worker
from sp_lab.conformance.cases import krea2_cases
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint
from sp_lab.tiny_models import krea2 as tiny
from sp_runtime.checkpoints.header import Header
from sp_runtime.detection import detect as detect_any
from sp_runtime.families import krea2


def test_key_plan_equals_diffusers_converter():
    from diffusers.loaders.single_file_utils import convert_krea2_transformer_checkpoint_to_diffusers
    model = tiny.build_tiny_model(3)
    original = tiny.original_state_dict(model)
    plan = krea2.original_plan(original)
    ours = {target: (transform or (lambda tensor: tensor))(tensor) for key, tensor in original.items()
            for target, transform in plan[key]}
    theirs = convert_krea2_transformer_checkpoint_to_diffusers(dict(original))
    assert set(ours) == set(theirs) == set(model.state_dict())
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs)


def test_released_header():
    """Krea 2 Turbo: 6144 wide (48 heads of 128 over 12), 28 blocks, a 12-layer Qwen3-VL 4B stack of 2560."""
    keys = {"first.weight": (6144, 64), "txtfusion.projector.weight": (1, 12), "tmlp.0.weight": (6144, 256),
            "txtfusion.layerwise_blocks.0.prenorm.scale": (2560,),
            "txtfusion.layerwise_blocks.0.mlp.gate.weight": (6912, 2560),
            "txtfusion.layerwise_blocks.1.mlp.gate.weight": (6912, 2560),
            "txtfusion.refiner_blocks.0.mlp.gate.weight": (6912, 2560),
            "txtfusion.refiner_blocks.1.mlp.gate.weight": (6912, 2560)}
    for block in range(28):
        keys.update({f"blocks.{block}.attn.wq.weight": (6144, 6144), f"blocks.{block}.attn.wk.weight": (1536, 6144),
                     f"blocks.{block}.mlp.gate.weight": (16384, 6144)})
    header = Header("krea2_turbo_fp8_scaled.safetensors",
                    {COMFY_PREFIX + key: ("BF16", shape) for key, shape in keys.items()})
    detection = detect_any(header)
    assert detection.family == "krea2"
    diffusers_defaults = {"in_channels": 64, "num_layers": 28, "attention_head_dim": 128, "num_attention_heads": 48,
                          "num_key_value_heads": 12, "intermediate_size": 16384, "timestep_embed_dim": 256,
                          "text_hidden_dim": 2560, "num_text_layers": 12, "text_num_attention_heads": 20,
                          "text_num_key_value_heads": 20, "text_intermediate_size": 6912,
                          "num_layerwise_text_blocks": 2, "num_refiner_text_blocks": 2,
                          "axes_dims_rope": (32, 48, 48), "rope_theta": 1000.0}
    assert detection.config == diffusers_defaults  # the released model is diffusers' default configuration


def test_references_need_a_method_and_their_zero_time_matters(tmp_path):
    """As ComfyUI: references without ref_latents_method are left out; with "index" they are modulated at the
    call's time, which differs from index_timestep_zero (so the suite's style case can fail); a bad shape is named."""
    path = write_tiny_checkpoint("krea2", str(tmp_path / "krea2.safetensors"), seed=1, prefix=COMFY_PREFIX)
    worker, context = single_rank_worker(path)
    x, t, inputs = krea2_cases()["style_refs"]
    outs = {}
    for method in (None, "index", "index_timestep_zero"):
        outs[method] = torch.empty(x.shape)
        worker.forward(x, t, {**inputs, "ref_latents_method": method}, outs[method], context)
    plain = torch.empty(x.shape)
    worker.forward(x, t, {"context": inputs["context"]}, plain, context)
    assert torch.equal(outs[None], plain)
    assert (outs["index"] - outs["index_timestep_zero"]).abs().max() > 1e-3
    with pytest.raises(ValueError, match=r"ref_latents\[0\] has shape"):
        worker.forward(x, t, {**inputs, "ref_latents": [x[:, :8]]}, plain, context)
