"""ChronoEdit 14B under SP: a Wan 2.1 I2V fine-tune (the file is Wan 2.1 I2V's keys; ComfyUI's template loads it as
Wan I2V with WanImageToVideo and ScaleROPE scale_t 7, so its two latent frames sit at rotary frames 0 and 7) equals
diffusers' own ChronoEditTransformer3DModel (temporal_skip_len 8: frames 0 and 7) on the same weights at Ulysses 1-4,
fp32, odd token counts, batch 2 and 1; without ScaleROPE it differs."""
from __future__ import annotations

import pytest
import torch

from family_support import assert_parity, relative_error
from sp_lab.references.wan import reference_forward
from sp_lab.tiny_models import COMFY_PREFIX, build_tiny_model, write_tiny_checkpoint

pytest_plugins = ["family_pools"]  # the shared per-degree worker pools

SEED = 25
SIZE = dict(num_attention_heads=6, attention_head_dim=12)  # diffusers' ChronoEdit splits the head as Wan only here
CHRONO_ROPE = {"scale_x": 1.0, "shift_x": 0.0, "scale_y": 1.0, "shift_y": 0.0, "scale_t": 7.0, "shift_t": 0.0}


def cases() -> dict:
    """(x, timestep, inputs) as WanImageToVideo with length 5 and the template's ScaleROPE give them: 2 latent frames
    (the input image, the edit), 30 and 2 tokens."""
    g = torch.Generator().manual_seed(SEED)

    def call(batch, height, width):
        inputs = {"context": torch.randn(batch, 512, 32, generator=g), "rope_options": dict(CHRONO_ROPE),
                  "clip_fea": torch.randn(batch, 5, 1280, generator=g)}
        return torch.randn(batch, 36, 2, height, width, generator=g), torch.tensor([700.0, 300.0])[:batch], inputs
    return {"30_tokens": call(2, 5, 6), "2_tokens_batch_1": call(1, 2, 2)}


def chronoedit_model():
    """diffusers' ChronoEditTransformer3DModel holding the tiny Wan I2V's weights."""
    from diffusers import ChronoEditTransformer3DModel
    wan = build_tiny_model("wan", SEED, variant="i2v", **SIZE)
    model = ChronoEditTransformer3DModel.from_config({key: value for key, value in wan.config.items()
                                                      if not key.startswith("_")})
    model.load_state_dict(wan.state_dict())
    return model.eval()


@pytest.fixture(scope="session")
def chrono_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("chronoedit") / "chrono_edit_14B.safetensors"
    return write_tiny_checkpoint("wan", str(path), seed=SEED, variant="i2v", prefix=COMFY_PREFIX, **SIZE)


@pytest.fixture(scope="session")
def references():
    model = chronoedit_model()
    return {case: reference_forward(model, x, t, **inputs) for case, (x, t, inputs) in cases().items()}


def test_fp32_parity_every_ulysses_degree(family_pool, chrono_file, references):
    handle = family_pool.load_model(chrono_file)
    assert handle.info.variant == "i2v"
    for case, (x, t, inputs) in cases().items():
        assert_parity(handle(x, t, **inputs), references[case], "float32",
                      f"chronoedit/degree{family_pool.config.world_size}/{case}")
    handle.unload()


def test_without_scale_rope_it_differs(references):
    x, t, inputs = cases()["30_tokens"]
    plain = reference_forward(build_tiny_model("wan", SEED, variant="i2v", **SIZE), x, t, **inputs)
    assert relative_error(plain, references["30_tokens"]) > 1e-3
