"""The conformance specs of the lab's families (sp_lab.families): the toy runs the whole suite; the synthetic
family does not (NOT_YET)."""
from __future__ import annotations

import os

import torch

from sp_lab.families.toy import ToyReference, save_toy_checkpoint

from . import Conformance, register_conformance

TOY = dict(in_channels=4, hidden=24, heads=3, depth=2, context_dim=8, y_dim=6, patch_size=2)


def toy_cases(seed: int = 7) -> dict:
    """35 image tokens, batch 2, a masked prompt; then 2 tokens (fewer than ranks), batch 1."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0, 4:] = False
    return {"35_tokens_masked": (rand(2, 4, 10, 14), torch.rand(2, generator=g),
                                 {"context": rand(2, 5, 8), "y": rand(2, 6), "attention_mask": mask}),
            "2_tokens": (rand(1, 4, 2, 4), torch.rand(1, generator=g), {"context": rand(1, 3, 8), "y": rand(1, 6)})}


def write_toy(folder: str) -> str:
    path = os.path.join(folder, "toy.safetensors")
    save_toy_checkpoint(path, seed=1, **TOY)
    return path


register_conformance("toy", Conformance(write=write_toy, reference=ToyReference, cases=toy_cases,
                                        tensor_parallel="not run by the executor"))

NOT_YET = {"synthetic": "benchmark specs: the workers draw a real family's weights and report that family"}
