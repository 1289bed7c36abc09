"""Parity: the toy through the pool at world 1, 2, 3 (and CFG-parallel) equals the in-process reference forward.

Token counts are not divisible by the degree, heads (3) are not divisible by 2, batch is 2, text is masked.
"""
from __future__ import annotations

import pytest
import torch

from sp_runtime import SPConfig
from sp_runtime.pool import WorkerPool
from family_support import at_worlds
from pool_kit import assert_matches, reference, toy_checkpoint, toy_inputs

pytest_plugins = ["family_pools"]  # the shared per-degree worker pools

CASES = {  # name: (x size, frames); token counts 35 and 2*3*4 + ... chosen to leave remainders
    "image": ((10, 14), None),      # 5 x 7 = 35 tokens
    "video": ((6, 8), 3),           # 3 x 3 x 4 = 36 tokens (not a multiple of 5 / 7 ...), 5-D input
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("toy")
    return {"image": toy_checkpoint(folder, "image.safetensors", seed=1),
            "video": toy_checkpoint(folder, "video.safetensors", seed=2, x_ndim=5, heads=4, hidden=32)}


def extras(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0, 4:] = False
    return {"ref_latents": [torch.randn(2, 4, 4, 6, generator=generator)], "guidance": 4.0, "attention_mask": mask}


@at_worlds(1, 2, 3)
@pytest.mark.parametrize("case", sorted(CASES))
def test_pool_equals_reference(plain_pool, checkpoints, case):
    size, frames = CASES[case]
    model = plain_pool.load_model(checkpoints[case])
    inputs = toy_inputs(seed=7, size=size, frames=frames)
    extra = extras(8) if case == "image" else {}
    out = model(inputs["x"], inputs["timestep"], context=inputs["context"], y=inputs["y"], **extra)
    expected = reference(checkpoints[case])(**inputs, **extra)
    assert_matches(out, expected, rel=1e-5)
    assert out.abs().max() > 0.1  # a real output, not zeros


@at_worlds(2)  # one world is enough for the dtype path
def test_bfloat16_weights_within_bf16_rounding(plain_pool, checkpoints):
    model = plain_pool.load_model(checkpoints["image"], dtype=torch.bfloat16)
    assert model.info.weight_dtype == "bfloat16" and model.info.compute_dtype == "bfloat16"
    inputs = {name: value.bfloat16() for name, value in toy_inputs(seed=9).items()}
    out = model(inputs["x"], inputs["timestep"], context=inputs["context"], y=inputs["y"])
    expected = reference(checkpoints["image"], dtype="bf16")(**inputs)
    assert_matches(out, expected, rel=3e-2)
    plain_pool.unload(model)


def test_cfg_parallel_layout(checkpoints):
    pool = WorkerPool(SPConfig(["cpu", "cpu"], ulysses_degree=1, cfg_degree=2))
    try:
        model = pool.load_model(checkpoints["image"])
        for batch in (2, 1):
            inputs = toy_inputs(seed=batch, batch=batch)
            out = model(inputs["x"], inputs["timestep"], context=inputs["context"], y=inputs["y"])
            assert_matches(out, reference(checkpoints["image"])(**inputs))
    finally:
        pool.close()
