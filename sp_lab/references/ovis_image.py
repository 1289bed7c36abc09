"""Ovis-Image's single-device reference (tests): diffusers' stock OvisImageTransformer2DModel forward (SwiGLU fused, as
diffusers keeps it) fed ComfyUI's Flux call as for LongCat-Image (the same ids: text at (0, i, i), images at
(index, row, column) in float32, rope_options applied, references by "index"), with the text norm's epsilon ComfyUI's
txt_norm uses (torch's default: the input dtype's)."""
from __future__ import annotations

import torch

from sp_lab.references.longcat_image import reference_forward as flux_call_forward


def reference_forward(model, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor, **inputs) -> torch.Tensor:
    model.context_embedder_norm.eps = None
    return flux_call_forward(model, x, timestep, context, **inputs)
