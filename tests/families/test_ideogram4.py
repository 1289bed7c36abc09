"""Ideogram 4 beyond the conformance suite (sp_lab.conformance: ComfyUI and diffusers files, fp32 parity at Ulysses
1-4, Ring 3, Ulysses 2 x Ring 2, Ulysses 2 x CFG 2, quantized file, LoRA): the key plan against the hand-written
ComfyUI writer, the released sizes, neighbours' files, the interleaved MRoPE as sp.tokens' PairFrequencies against
diffusers' own rotary, and refusals at the call naming the input."""
from __future__ import annotations

import pytest
import torch

from family_support import assert_parity
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint
from sp_lab.tiny_models import ideogram4 as tiny
from sp_runtime.checkpoints.header import Header, read_checkpoint_header
from sp_runtime.detection import detect as detect_any
from sp_runtime.families import ideogram4

pytest_plugins = ["family_pools"]


def test_key_plan_inverts_the_comfyui_writer():
    model = tiny.build_tiny_model(3)
    original = tiny.original_state_dict(model)
    plan = ideogram4.original_plan(original, model.config)
    got = {target: transform(original[key]) if transform else original[key]
           for key, targets in plan.items() for target, transform in targets}
    state = model.state_dict()
    assert got.keys() == state.keys() and all(torch.equal(got[key], state[key]) for key in state)


def released_header() -> dict:
    """Header entries of the released Ideogram 4 (18 heads of 256, 34 blocks, 128 latent channels, 53248 features)."""
    keys = {"input_proj.weight": (4608, 128), "embed_image_indicator.weight": (2, 4608),
            "llm_cond_proj.weight": (4608, 53248), "adaln_proj.weight": (512, 4608)}
    for block in range(34):
        keys.update({f"layers.{block}.attention.qkv.weight": (3 * 4608, 4608),
                     f"layers.{block}.attention.norm_q.weight": (256,),
                     f"layers.{block}.feed_forward.w1.weight": (12288, 4608)})
    return {COMFY_PREFIX + key: ("F8_E4M3", shape) for key, shape in keys.items()}


def test_released_header_and_neighbours(tmp_path):
    detection = detect_any(Header("ideogram4_fp8_scaled.safetensors", released_header()))
    assert (detection.family, detection.prefix) == ("ideogram4", COMFY_PREFIX)
    assert detection.config == {"in_channels": 128, "num_layers": 34, "attention_head_dim": 256,
                                "num_attention_heads": 18, "intermediate_size": 12288, "adaln_dim": 512,
                                "llm_features_dim": 53248, "rope_theta": 5_000_000, "mrope_section": (24, 20, 20),
                                "norm_eps": 1e-5}
    for family in ("lumina2", "cosmos"):
        header = read_checkpoint_header(write_tiny_checkpoint(family, str(tmp_path / f"{family}.safetensors")))
        assert ideogram4.detect(header) is None and detect_any(header).family == family
    ours = read_checkpoint_header(write_tiny_checkpoint("ideogram4", str(tmp_path / "i.safetensors")))
    assert detect_any(ours).family == "ideogram4"


@pytest.mark.parametrize("head_dim, sections", [(256, (24, 20, 20)), (64, (6, 5, 5))])
def test_pair_frequencies_rotate_as_diffusers_mrope(head_dim, sections):
    """The executor's rotary (PairFrequencies tables, interleaved pairs) on q reordered by split_half_order equals
    diffusers' Ideogram4MRoPE + rotate_half on q, at text and offset image positions (float32 angles both)."""
    from diffusers.models.transformers.transformer_ideogram4 import Ideogram4MRoPE, _rotate_half
    from sp_runtime.sp.tokens import PairFrequencies, rotate, split_half_order
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.arange(7)[:, None].expand(-1, 3), 65536 + torch.randint(0, 90, (20, 3), generator=g)])
    query = torch.randn(1, ids.shape[0], 2, head_dim, generator=g)
    cos, sin = Ideogram4MRoPE(head_dim, 5_000_000, sections)(ids[None])
    want = query * cos[:, :, None] + _rotate_half(query) * sin[:, :, None]
    order = split_half_order(head_dim, head_dim)
    tables = PairFrequencies.interleaved_mrope(head_dim, 5_000_000, sections).tables(ids.float())
    got = rotate(query[..., order], tables)
    assert torch.allclose(got, want[..., order], atol=1e-5, rtol=0)
    wrong = PairFrequencies.interleaved_mrope(head_dim, 5_000_000, (sections[0], 0, 0)).tables(ids.float())
    assert not torch.allclose(rotate(query[..., order], wrong), want[..., order], atol=1e-3)


@pytest.mark.parametrize("family_pool", [2], indirect=True)
def test_refusals_name_the_input(family_pool, family_subject):
    subject = family_subject("ideogram4")
    handle = family_pool.load_model(subject.path)
    x, t, inputs = subject.spec.cases()["40_tokens"]
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, 3:] = 0
    bad = {"padded text": ({**inputs, "attention_mask": mask}, x), "context": ({**inputs, "context":
                                                                               inputs["context"][..., :8]}, x),
           "8 channels": (inputs, x[:, :8])}
    for needle, (changed, latent) in bad.items():
        with pytest.raises(Exception, match=needle):
            handle(latent, t, **changed)
    everything = {**inputs, "attention_mask": torch.ones(2, 5, dtype=torch.long)}
    assert_parity(handle(x, t, **everything), subject.outputs["40_tokens"], "float32", "ideogram4_after_refusals")
    handle.unload()
