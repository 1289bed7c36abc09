"""Anima beyond the conformance suite (sp_lab.conformance: its ComfyUI file with and without prefix, fp32 parity of
ids / packed / adapted-context calls at Ulysses 1-4, Ring 3, Ulysses 2 x Ring 2, Ulysses 2 x CFG 2, TP, quantized
file, LoRA): the released sizes from a header, Cosmos' and Anima's files told apart, the adapter's key plan, the
host's packing of ComfyUI's extra_conds inputs (exact through bf16 / fp16 casts), refusals at the call by name."""
from __future__ import annotations

import pytest
import torch

from family_support import assert_parity
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint
from sp_runtime.checkpoints.header import Header, read_checkpoint_header
from sp_runtime.detection import detect as detect_any
from sp_runtime.families import anima, cosmos
from sp_runtime.families.anima import text
from test_cosmos import released_header

pytest_plugins = ["family_pools"]


def anima_header(extra: tuple = ()) -> dict:
    """Header entries of Anima base (Cosmos-Predict2 2B t2i with a 6-layer 1024-wide adapter, T5 vocabulary)."""
    keys = {"llm_adapter.embed.weight": (32128, 1024), "llm_adapter.out_proj.weight": (1024, 1024)}
    for block in range(6):
        for attention in ("self_attn", "cross_attn"):
            keys[f"llm_adapter.blocks.{block}.{attention}.q_proj.weight"] = (1024, 1024)
            keys[f"llm_adapter.blocks.{block}.{attention}.k_proj.weight"] = (1024, 1024)
    keys.update({key: (1024,) for key in extra})
    return {**released_header(), **{COMFY_PREFIX + key: ("BF16", shape) for key, shape in keys.items()}}


def test_released_header_and_neighbours(tmp_path):
    detection = detect_any(Header("anima-base-v1.0.safetensors", anima_header()))
    assert (detection.family, detection.prefix) == ("anima", COMFY_PREFIX)
    assert {key: detection.config[key] for key in anima.CONFIG_KEYS if key.startswith(("adapter_", "text", "rope"))} \
        == {"text_embed_dim": 1024, "rope_scale": (1.0, 4.0, 4.0), "adapter_vocabulary": 32128, "adapter_width": 1024,
            "adapter_text_dim": 1024, "adapter_layers": 6, "adapter_self_attention": True}
    assert cosmos.detect(Header("a.safetensors", anima_header())) is None
    with pytest.raises(ValueError, match="extra_pos_embedder"):
        detect_any(Header("anima.safetensors", anima_header(("extra_pos_embedder.pos_emb_h",))))
    ours = read_checkpoint_header(write_tiny_checkpoint("anima", str(tmp_path / "a.safetensors")))
    plain = read_checkpoint_header(write_tiny_checkpoint("cosmos", str(tmp_path / "c.safetensors")))
    assert (detect_any(ours).family, detect_any(plain).family) == ("anima", "cosmos")
    assert anima.detect(plain) is None


def test_key_plan_keeps_adapter_names_and_renames_the_dit():
    plan = anima.original_plan(["llm_adapter.blocks.0.self_attn.q_proj.weight", "blocks.0.self_attn.q_proj.weight"])
    assert plan == {"llm_adapter.blocks.0.self_attn.q_proj.weight": [("llm_adapter.blocks.0.self_attn.q_proj.weight",
                                                                       None)],
                    "blocks.0.self_attn.q_proj.weight": [("transformer_blocks.0.attn1.to_q.weight", None)]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_packed_prompt_survives_comfyui_casts(dtype):
    """ComfyUI casts c_crossattn to the inference dtype: ids up to the T5 vocabulary, lengths and weights come back."""
    states, ids = torch.randn(1, 37, 1024).to(dtype), torch.tensor([[0, 1, 31, 32, 1023, 32127, 5000]])
    weights = torch.tensor([1.0, 0.5, 1.25, 1.0, 2.0, 0.75, 1.0]).reshape(1, 7, 1).to(dtype)
    packed = anima.COMFY.attributes(None)["preprocess_text_embeds"](states, ids, t5xxl_weights=weights)
    assert packed.shape == (1, text.PACK_ROWS, 1024) and packed.dtype == dtype
    cast = packed.to(torch.float32).to(dtype)
    got_states, got_ids, got_weights = text.unpack(cast[0])
    assert text.is_packed(cast) and torch.equal(got_ids, ids) and torch.equal(got_states, states)
    assert torch.equal(got_weights, weights)
    assert not text.is_packed(torch.randn(2, 512, 1024))


@pytest.mark.parametrize("family_pool", [2], indirect=True)
def test_refusals_name_the_input(family_pool, family_subject):
    subject = family_subject("anima")
    handle = family_pool.load_model(subject.path)
    x, t, inputs = subject.spec.cases()["35_tokens"]
    packed = subject.spec.cases()["packed_cfg"][2]["context"]
    bad = {"padding_mask": ({**inputs, "padding_mask": torch.zeros(2, 1, 10, 14)}, t),
           "per-frame timesteps": (inputs, t[:, None].repeat(1, 3)),
           "Qwen3 text encoder output": ({**inputs, "context": inputs["context"][..., :8]}, t),
           "integer token ids": ({**inputs, "t5xxl_ids": inputs["t5xxl_ids"].float()}, t),
           "one weight per t5xxl_ids token": ({**inputs, "t5xxl_weights": inputs["t5xxl_weights"][:, :3]}, t),
           "t5xxl_ids or a packed prompt": ({**inputs, "context": packed}, t),
           "t5xxl_weights come with t5xxl_ids": ({"context": inputs["context"],
                                                  "t5xxl_weights": inputs["t5xxl_weights"]}, t)}
    for needle, (changed, timestep) in bad.items():
        with pytest.raises(Exception, match=needle):
            handle(x, timestep, **changed)
    assert_parity(handle(x, t, **inputs), subject.outputs["35_tokens"], "float32", "anima_after_refusals/35_tokens")
    handle.unload()


@pytest.mark.parametrize("family_pool", [2], indirect=True)
def test_packed_prompts_of_other_lengths_over_512_are_refused(family_pool, family_subject):
    """Two packed prompts whose adapter outputs differ in length (over 512 T5 tokens): ComfyUI never batches them."""
    subject = family_subject("anima")
    handle = family_pool.load_model(subject.path)
    x, t, _ = subject.spec.cases()["packed_cfg"]
    prompts = [text.pack(torch.randn(1, text_length, 48), torch.randint(0, 100, (1, ids)))
               for text_length, ids in ((5, 600), (100, 520))]
    with pytest.raises(Exception, match="more than 512 T5 tokens"):
        handle(x, t, context=torch.cat(prompts))
    handle.unload()
