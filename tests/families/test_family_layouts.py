"""Full model forwards of Qwen-Image, Flux and Wan through the pool under Ring, the Ulysses x Ring hybrid and
CFG-parallel (u1r3, u2r2, u2cfg2) equal diffusers' single-process forward: batch 2 (split by CFG) and batch 1 (all
ranks), odd latents and token counts, a masked prompt, 6 heads."""
from __future__ import annotations

import pytest
import torch

from family_support import assert_parity
from sp_lab.references import reference_forward
from sp_lab.tiny_models import build_tiny_model, write_tiny_checkpoint

pytest_plugins = ["family_pools"]  # the shared layout pools (u1r3, u2r2, u2cfg2)

SEED = 5
FAMILIES = ("qwen_image", "flux", "wan")


def make_cases(family: str) -> dict:
    g = torch.Generator().manual_seed(11)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0  # the uncond prompt is shorter
    if family == "qwen_image":
        return {"batch_2_masked": (rand(2, 16, 1, 9, 7), torch.tensor([0.7, 0.7]),
                                   {"context": rand(2, 9, 32), "attention_mask": mask}),
                "batch_1": (rand(1, 16, 1, 5, 6), torch.tensor([0.4]), {"context": rand(1, 4, 32)})}
    if family == "wan":  # 45 tokens (5 frames of 3 x 3 patches); then 3 tokens, fewer than the ranks
        return {"batch_2": (rand(2, 16, 5, 6, 5), torch.tensor([700.0, 700.0]), {"context": rand(2, 7, 32)}),
                "batch_1": (rand(1, 16, 3, 2, 2), torch.tensor([300.0]), {"context": rand(1, 7, 32)})}
    return {"batch_2": (rand(2, 16, 9, 7), torch.tensor([0.7, 0.7]),
                        {"context": rand(2, 9, 32), "y": rand(2, 24), "guidance": torch.tensor([3.5, 3.5])}),
            "batch_1": (rand(1, 16, 5, 6), torch.tensor([0.4]),
                        {"context": rand(1, 4, 32), "y": rand(1, 24), "guidance": torch.tensor([3.5])})}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("families")
    return {family: write_tiny_checkpoint(family, str(folder / f"{family}.safetensors"), seed=SEED)
            for family in FAMILIES}


@pytest.fixture(scope="module")
def references():
    refs = {}
    for family in FAMILIES:
        model = build_tiny_model(family, SEED)
        refs[family] = {name: reference_forward(family)(model, x, t, **inputs)
                        for name, (x, t, inputs) in make_cases(family).items()}
    return refs


def test_family_forward_equals_single_process(layout_pool, checkpoints, references):
    layout, pool = layout_pool
    for family in FAMILIES:
        handle = pool.load_model(checkpoints[family])
        for name, (x, t, inputs) in make_cases(family).items():
            out = handle(x, t, **inputs)
            assert_parity(out, references[family][name], "float32", f"{layout}/{family}/{name}")
        pool.unload(handle)


def test_the_cases_can_fail(references):
    """Guard: the two prompts of a batch differ, so a swapped or duplicated CFG half would be caught."""
    for family in FAMILIES:
        for name, out in references[family].items():
            if out.shape[0] == 2:
                assert (out[0] - out[1]).abs().max() > 1e-2, (family, name)
