"""Cosmos-Predict2 beyond the conformance suite (sp_lab.conformance: every file layout, fp32 parity at Ulysses 1-4,
Ring 3, Ulysses 2 x Ring 2, Ulysses 2 x CFG 2, quantized file, LoRA): the key plan against diffusers' converter, the
released sizes as ComfyUI's detection fixes them, neighbours' files (Anima's: test_anima.py), learnable extra positions
refused by name, and refusals at the call (padding_mask, per-frame timesteps, a wrong text width) naming the input."""
from __future__ import annotations

import pytest
import torch

from family_support import assert_parity
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint
from sp_lab.tiny_models import cosmos as tiny
from sp_runtime.checkpoints.header import Header, read_checkpoint_header
from sp_runtime.detection import detect as detect_any
from sp_runtime.families import cosmos, wan

pytest_plugins = ["family_pools"]


def test_key_plan_equals_diffusers_converter():
    """Our plan over ComfyUI's names gives the tensors diffusers' convert_cosmos_transformer_checkpoint_to_diffusers
    gives, and every parameter of the model."""
    from diffusers.loaders.single_file_utils import convert_cosmos_transformer_checkpoint_to_diffusers
    model = tiny.build_tiny_model(3)
    original = tiny.original_state_dict(model)
    plan = cosmos.original_plan(original)
    ours = {target: tensor for key, tensor in original.items() for target, _ in plan[key]}
    theirs = convert_cosmos_transformer_checkpoint_to_diffusers(dict(original))
    assert set(ours) == set(theirs) == set(model.state_dict())
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs)


def released_header(extra: tuple = ()) -> dict:
    """Header entries of Cosmos-Predict2 2B text-to-image (2048 wide, 16 heads of 128, 28 blocks, T5 1024)."""
    keys = {"x_embedder.proj.1.weight": (2048, 68), "t_embedding_norm.weight": (2048,),
            "t_embedder.1.linear_1.weight": (2048, 2048), "final_layer.linear.weight": (64, 2048)}
    for block in range(28):
        keys[f"blocks.{block}.mlp.layer1.weight"] = (8192, 2048)
        keys[f"blocks.{block}.self_attn.q_norm.weight"] = (128,)
        keys[f"blocks.{block}.cross_attn.k_proj.weight"] = (2048, 1024)
        keys[f"blocks.{block}.adaln_modulation_self_attn.1.weight"] = (256, 2048)
    keys.update({key: (1024,) for key in extra})
    return {COMFY_PREFIX + key: ("BF16", shape) for key, shape in keys.items()}


def test_released_header_neighbours_and_refused_files(tmp_path):
    detection = detect_any(Header("cosmos_predict2_2B_t2i.safetensors", released_header()))
    assert (detection.family, detection.variant, detection.prefix) == ("cosmos", "t2i", COMFY_PREFIX)
    assert {key: detection.config[key] for key in cosmos.CONFIG_KEYS} == {
        "in_channels": 16, "out_channels": 16, "num_attention_heads": 16, "attention_head_dim": 128,
        "num_layers": 28, "mlp_ratio": 4.0, "text_embed_dim": 1024, "adaln_lora_dim": 256,
        "rope_scale": (1.0, 4.0, 4.0)}
    with pytest.raises(ValueError, match="extra_pos_embedder"):
        detect_any(Header("cosmos_predict2_2B_t2i.safetensors", released_header(("extra_pos_embedder.pos_emb_h",))))
    for family in ("wan", "lumina2"):
        header = read_checkpoint_header(write_tiny_checkpoint(family, str(tmp_path / f"{family}.safetensors")))
        assert cosmos.detect(header) is None and detect_any(header).family == family
    ours = read_checkpoint_header(write_tiny_checkpoint("cosmos", str(tmp_path / "c.safetensors")))
    assert wan.detect(ours) is None and detect_any(ours).family == "cosmos"


@pytest.mark.parametrize("family_pool", [2], indirect=True)
def test_refusals_name_the_input(family_pool, family_subject):
    subject = family_subject("cosmos")
    handle = family_pool.load_model(subject.path)
    x, t, inputs = subject.spec.cases()["odd_video"]
    bad = {"padding_mask": ({**inputs, "padding_mask": torch.zeros(2, 1, 5, 6)}, t),
           "per-frame timesteps": (inputs, t[:, None].repeat(1, 3)),
           "context": ({**inputs, "context": inputs["context"][..., :8]}, t)}
    for needle, (changed, timestep) in bad.items():
        with pytest.raises(Exception, match=needle):
            handle(x, timestep, **changed)
    assert_parity(handle(x, t, **inputs), subject.outputs["odd_video"], "float32", "cosmos_after_refusals/odd_video")
    handle.unload()
