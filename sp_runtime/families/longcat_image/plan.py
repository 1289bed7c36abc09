"""LongCat-Image's sequence-parallel plan: Flux.1's (image and reference tokens split, the text replicated and joined
in every block) for ComfyUI's Flux model with LongCat's settings: text ids (0, i, i), no pooled text or guidance
(FluxGuidance's value is dropped by ComfyUI's LongCatImage), image ids in float32 after the rope_options shift the
host's LongCatImage model adds (t + 1, rows and columns + text length), the time embedding of sigma x 1000."""
from __future__ import annotations

from dataclasses import replace

import torch

from ..flux import PATCH, PLAN as FLUX_PLAN, image_and_text
from ..flux.plan import placements


def layout(call):
    return image_and_text(call, PATCH, placements, "offset", text_ids, torch.float32)


def text_ids(length: int, device) -> torch.Tensor:
    ids = torch.zeros(length, 3, device=device)
    ids[:, 1] = ids[:, 2] = torch.arange(length, device=device)
    return ids


def condition(call) -> None:
    call.temb = call.model.time_embed(call.sigma() * 1000, call.dtype)


PLAN = replace(FLUX_PLAN, layout=layout, condition=condition)
