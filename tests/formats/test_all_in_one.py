"""All-in-one checkpoints (diffusion model under `model.diffusion_model.` beside a text encoder and a VAE, as
ComfyUI's "Load Checkpoint" takes them): the pool finds, loads and runs only the diffusion part, equal to diffusers'
model of the same weights."""
from __future__ import annotations

import pytest
import torch

from family_support import assert_parity, at_worlds
from sp_lab.references import reference_forward
from sp_runtime.detection import detect
from sp_lab.tiny_models import COMFY_PREFIX, build_tiny_model, write_tiny_checkpoint
from sp_lab.tiny_models.weights import pack_all_in_one
from sp_lab.conformance.cases import qwen_flux_wan_cases as make_cases

pytest_plugins = ["family_pools"]  # the shared plain pools (degree 2 here)
SEED = 5
FAMILIES = ("qwen_image", "flux", "wan")


def other_parts() -> dict[str, torch.Tensor]:
    """Text encoder and VAE entries as all-in-one files hold them (bf16 and fp8 text encoders, a scaled-fp8
    marker, a VAE whose keys share names with nothing in the diffusion model)."""
    g = torch.Generator().manual_seed(3)
    return {
        "text_encoders.clip_l.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight":
            torch.randn(8, 8, generator=g).bfloat16(),
        "text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q.weight":
            torch.randn(64, 64, generator=g).to(torch.float8_e4m3fn),
        "text_encoders.t5xxl.transformer.scaled_fp8": torch.zeros(0, dtype=torch.float8_e4m3fn),
        "vae.decoder.conv_in.weight": torch.randn(8, 4, 3, 3, generator=g).half(),
        "vae.encoder.mid.attn_1.q.weight": torch.randn(512, 512, generator=g).half(),  # the file's largest tensor
    }


@pytest.fixture(scope="session")
def all_in_one_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("all_in_one")
    files = {}
    for family in FAMILIES:
        diffusion = write_tiny_checkpoint(family, str(folder / f"{family}_unet.safetensors"), seed=SEED,
                                          prefix=COMFY_PREFIX)
        files[family] = pack_all_in_one(diffusion, str(folder / f"{family}.safetensors"), other_parts())
    return files


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_detection_reads_the_diffusion_part_only(family, all_in_one_files):
    detection = detect(all_in_one_files[family])
    assert (detection.family, detection.prefix, detection.quant) == (family, COMFY_PREFIX, "")


@at_worlds(2)
def test_pool_runs_the_diffusion_part_of_all_in_one_files(plain_pool, all_in_one_files):
    for family in FAMILIES:
        handle = plain_pool.load_model(all_in_one_files[family], dtype="default")
        assert handle.info.weight_dtype == "float32"  # the diffusion part's precision, not the bf16/fp8 parts'
        model = build_tiny_model(family, SEED)
        for name, (x, t, inputs) in make_cases(family).items():
            expected = reference_forward(family)(model, x, t, **inputs)
            assert_parity(handle(x, t, **inputs), expected, "float32", f"all_in_one/{family}/{name}")
