"""Adding a family is one plan and one registry line: a throwaway family declared here (not a test file: the
conformance suite, tests/families/test_family_conformance.py, imports it), over a tiny diffusers
SD3Transformer2DModel (a DiT none of the project's families uses: learned positions, no rotary, joint attention
with the image first, a last block that leaves the text unprojected, (p, q, c) output features), runs through the
pool at Ulysses 1-4 and under Ring / Ulysses x Ring / CFG layouts against diffusers' own single-device forward,
with no test of its own: the suite runs it because it is registered.

This module is the family: register_family and register_conformance at import (so every pool of the session,
started later, knows it, and the suite parametrizes over it) and the workers import it by name (its folder goes on
their PYTHONPATH). Nothing of the project is changed for it.
"""
from __future__ import annotations

import functools
import json
import os

import pytest
import torch

from sp_lab.conformance import Conformance, register_conformance
from sp_runtime.families import register_family
from sp_runtime.contract import Detection, ModelInfo
from sp_runtime.checkpoints.loading import choose_dtypes
from sp_runtime.checkpoints.header import FAMILY_METADATA_KEY
from sp_runtime.sp import Output, Part, Plan, PlanWorker, Stage, Stream, text_stream
from sp_runtime.sp.tokens import TokenGrid

FAMILY, DESCRIPTION = "sd3_test", ""
CONFIG = dict(sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=3, attention_head_dim=8,
              num_attention_heads=5, joint_attention_dim=12, caption_projection_dim=40, pooled_projection_dim=8,
              pos_embed_max_size=16, qk_norm="rms_norm")
HERE = os.path.dirname(os.path.abspath(__file__))  # this module, and tests/ for family_support
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH")]))
register_family(FAMILY, __name__)


# ----- the family: detection, loading, and its plan -----

def detect(header):
    if header.metadata.get(FAMILY_METADATA_KEY) != FAMILY:
        return None
    return Detection(family=FAMILY, config=json.loads(header.metadata["config"]), files=(header.path,))


def load(request, detection, device, groups, progress):
    from safetensors.torch import load_file
    model = build(detection.config)
    model.load_state_dict(load_file(request.path))
    info = ModelInfo(family=FAMILY, variant="", in_channels=CONFIG["in_channels"],
                     out_channels=CONFIG["out_channels"], x_ndim=4)
    return PlanWorker(model.to(device), info, PLAN, choose_dtypes("float32"))


def layout(call) -> list[Stream]:
    """PatchEmbed adds learned positions, so every rank embeds the (small) latent whole and keeps its tokens."""
    x = call.input("x")
    grid = TokenGrid.of(x.shape[-2], x.shape[-1], call.config.patch_size)
    image = Part(call.model.pos_embed(x), None, lambda model, tokens: tokens, Output(grid))
    return [Stream("image", [image]), text_stream(call.input("context"), None, "context_embedder")]


def condition(call) -> None:
    call.temb = call.model.time_text_embed(call.sigma(), call.input("y"))


def joint_block(block, call) -> None:
    text, call.image = block(hidden_states=call.image, encoder_hidden_states=call.text, temb=call.temb)
    call.text = call.text if text is None else text  # the last block returns no text


def check(call) -> None:
    if call.x.dim() != 4 or call.x.shape[1] != 4 or call.x.shape[-1] % 2 or call.x.shape[-2] % 2:
        raise ValueError(f"x has shape {tuple(call.x.shape)}; this model takes [B, 4, H, W] with H, W even")


PLAN = Plan(check=check, layout=layout, condition=condition, stages=(Stage("transformer_blocks", joint_block),),
            head=lambda call: call.model.proj_out(call.model.norm_out(call.image, call.temb)),
            output_tokens=lambda call, tokens: tokens.unflatten(-1, (2, 2, 4)).permute(0, 1, 4, 2, 3).flatten(2))


# ----- what the conformance suite needs of it -----

def build(config):
    from diffusers import SD3Transformer2DModel
    torch.manual_seed(3)
    model = SD3Transformer2DModel(**config).eval()
    with torch.no_grad():
        for parameter in model.parameters():  # diffusers zero-initialises some layers: give every weight a value
            parameter.copy_(torch.randn_like(parameter) / max(1, parameter.shape[-1]) ** 0.5)
    return model


def make_cases():
    g = torch.Generator().manual_seed(1)

    def rand(*shape):
        return torch.randn(*shape, generator=g)
    return {"35_tokens": (rand(2, 4, 10, 14), torch.tensor([700.0, 300.0]),
                          {"context": rand(2, 7, 12), "y": rand(2, 8)}),
            "2_tokens": (rand(1, 4, 2, 4), torch.tensor([500.0]), {"context": rand(1, 3, 12), "y": rand(1, 8)})}


def write(folder: str) -> str:
    from safetensors.torch import save_file
    path = os.path.join(folder, "tiny.safetensors")
    save_file(build(CONFIG).state_dict(), path, metadata={FAMILY_METADATA_KEY: FAMILY, "config": json.dumps(CONFIG)})
    return path


def reference_forward(model, x, timestep, context, y):
    """diffusers' own single-device forward (the conformance suite's reference, through sp_lab.references)."""
    with torch.no_grad():
        return model(hidden_states=x, encoder_hidden_states=context, pooled_projections=y, timestep=timestep,
                     return_dict=False)[0]


register_conformance(FAMILY, Conformance(write=write, reference=lambda path: functools.partial(reference_forward,
                                                                                                build(CONFIG)),
                                         cases=make_cases))
