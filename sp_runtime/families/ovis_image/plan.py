"""Ovis-Image's sequence-parallel plan: Flux.1's (image and reference tokens split, the text replicated and joined in
every block) for ComfyUI's Flux model with Ovis' settings: the text RMS-normed before its embedder, text ids (0, i, i),
image ids in float32, no pooled text or guidance, the time embedding of sigma x 1000. Tensor parallelism is refused:
diffusers' single blocks split their SwiGLU MLP at a fixed width."""
from __future__ import annotations

from dataclasses import replace

import torch

from ..flux import PATCH, PLAN as FLUX_PLAN, image_and_text
from ..flux.plan import placements
from ..longcat_image.plan import text_ids


def layout(call):
    return image_and_text(call, PATCH, placements, "offset", text_ids, torch.float32, embed_text)


def embed_text(model, text: torch.Tensor) -> torch.Tensor:
    return model.context_embedder(model.context_embedder_norm(text))


def condition(call) -> None:
    model = call.model
    call.temb = model.timestep_embedder(model.time_proj(call.sigma() * 1000).to(call.dtype))


PLAN = replace(FLUX_PLAN, layout=layout, condition=condition,
               tensor_parallel="its single blocks split their SwiGLU MLP at diffusers' fixed width: not split yet")
