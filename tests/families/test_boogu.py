"""Boogu-Image beyond the conformance suite (sp_lab.conformance: the ComfyUI file, fp32 parity at Ulysses 1-4, Ring,
hybrid and CFG layouts, TP 2, quantized file, LoRA): the released sizes as ComfyUI's detection reads them (OmniGen2
and Lumina 2 files kept apart), the references' order and batch, and the inputs it refuses by name."""
from __future__ import annotations

import pytest
import torch

from family_support import single_rank_output, single_rank_worker
from sp_lab.conformance.cases import boogu_cases
from sp_lab.tiny_models import COMFY_PREFIX, write_tiny_checkpoint
from sp_runtime.checkpoints.header import Header
from sp_runtime.detection import detect as detect_any
from sp_runtime.families import boogu, lumina2


def released_keys(double: int = 8, feed_forward: int = 13568) -> dict:
    """Header entries of Boogu-Image 0.1 (3360 wide, 28 heads of 120 over 7, 8 double / 32 single blocks, 2
    refiners, Qwen3-VL 8B's 4096 features)."""
    keys = {"x_embedder.weight": (3360, 64), "ref_image_patch_embedder.weight": (3360, 64),
            "time_caption_embed.timestep_embedder.linear_1.bias": (1024,),
            "time_caption_embed.caption_embedder.0.weight": (4096,),
            "time_caption_embed.caption_embedder.1.weight": (3360, 4096)}
    for stem, count in (("single_stream_layers", 32), ("noise_refiner", 2), ("context_refiner", 2)):
        for block in range(count):
            keys.update({f"{stem}.{block}.attn.norm_q.weight": (120,), f"{stem}.{block}.attn.to_k.weight": (840, 3360),
                         f"{stem}.{block}.feed_forward.linear_1.weight": (feed_forward, 3360)})
    for block in range(double):
        keys[f"double_stream_layers.{block}.img_instruct_attn.processor.img_to_q.weight"] = (3360, 3360)
    return {COMFY_PREFIX + key: ("F8_E4M3", shape) for key, shape in keys.items()}


def test_released_header_and_neighbours_apart():
    detection = detect_any(Header("boogu_image_turbo_fp8_scaled.safetensors", released_keys()))
    assert (detection.family, detection.variant) == ("boogu", "image")
    assert detection.config == {"patch_size": 2, "in_channels": 16, "hidden_size": 3360, "num_layers": 32,
                                "num_double_stream_layers": 8, "num_refiner_layers": 2, "num_attention_heads": 28,
                                "num_kv_heads": 7, "multiple_of": 256, "ffn_dim_multiplier": None, "norm_eps": 1e-5,
                                "cap_feat_dim": 4096, "axes_dim_rope": (40, 40, 40), "axes_lens": (2048, 1664, 1664)}
    assert boogu.COMFY.model_class(detection.variant) == "Boogu"
    # OmniGen2 (no double-stream blocks, `layers.`): not Boogu, named by its signature
    omnigen2 = {key.replace("single_stream_layers", "layers"): value for key, value in released_keys(0).items()}
    assert boogu.detect(Header("omnigen2_fp16.safetensors", omnigen2)) is None
    with pytest.raises(ValueError, match="OmniGen2"):
        detect_any(Header("omnigen2_fp16.safetensors", omnigen2))
    assert lumina2.detect(Header("boogu_image_edit_int8_convrot.safetensors", released_keys())) is None
    with pytest.raises(ValueError, match=r"'odd\.safetensors'.*feed-forward width 9000"):
        boogu.detect(Header("odd.safetensors", released_keys(feed_forward=9000)))


def test_a_lumina2_file_is_not_boogu(tmp_path):
    path = write_tiny_checkpoint("lumina2", str(tmp_path / "lumina2.safetensors"), seed=1, prefix=COMFY_PREFIX)
    assert detect_any(path).family == "lumina2"


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    path = write_tiny_checkpoint("boogu", str(tmp_path_factory.mktemp("boogu") / "boogu.safetensors"), seed=4,
                                 prefix=COMFY_PREFIX)
    return single_rank_worker(path)


def test_references_count_in_order_and_serve_every_item(worker):
    """The edit's references change the output, their order too (index embeddings and rotary shifts); a batch-1
    reference serves both items as the same reference repeated; an all-ones mask (ComfyUI drops it) changes
    nothing."""
    x, t, inputs = boogu_cases()["edit_two_refs"]
    edited = single_rank_output(worker, x, t, inputs)
    first, second = inputs["ref_latents"]
    assert (single_rank_output(worker, x, t, {**inputs, "ref_latents": None}) - edited).abs().max() > 1e-3
    assert (single_rank_output(worker, x, t, {**inputs, "ref_latents": [second, first]}) - edited).abs().max() > 1e-3
    single = single_rank_output(worker, x, t, {**inputs, "ref_latents": [first[:1], second[:1]]})
    repeated = single_rank_output(worker, x, t, {**inputs, "ref_latents": [first[:1].repeat(2, 1, 1, 1),
                                                            second[:1].repeat(2, 1, 1, 1)]})
    assert torch.allclose(single, repeated, atol=1e-6)
    ones = torch.ones(2, inputs["context"].shape[1], dtype=torch.long)
    assert torch.allclose(single_rank_output(worker, x, t, {**inputs, "attention_mask": ones}), edited, atol=1e-6)


def test_refusals_by_name(worker):
    x, t, inputs = boogu_cases()["few_tokens"]
    mask = torch.ones(1, 3, dtype=torch.long)
    mask[0, 2] = 0
    with pytest.raises(ValueError, match="attention_mask / num_tokens: a padded instruction"):
        single_rank_output(worker, x, t, {**inputs, "attention_mask": mask, "num_tokens": 2})
    with pytest.raises(ValueError, match=r"padded instruction \(2 of 3 tokens\)"):
        single_rank_output(worker, x, t, {**inputs, "num_tokens": 2})
    with pytest.raises(ValueError, match="ref_latents: 6 reference latents"):
        single_rank_output(worker, x, t, {**inputs, "ref_latents": [torch.zeros(1, 16, 2, 2)] * 6})
    with pytest.raises(ValueError, match=r"ref_latents\[0\] has shape \(1, 4, 2, 2\)"):
        single_rank_output(worker, x, t, {**inputs, "ref_latents": [torch.zeros(1, 4, 2, 2)]})
    with pytest.raises(ValueError, match=r"x has shape \(1, 16, 1, 2, 4\)"):
        single_rank_output(worker, x[:, :, None], t, inputs)
    with pytest.raises(ValueError, match="needs context"):
        single_rank_output(worker, x, t, {})
