"""Flux.1's single-device reference (tests, demo, benchmarks): diffusers' stock forward and processors, fed
ComfyUI's call with ComfyUI's packing and position ids."""
from __future__ import annotations

from typing import Optional

import torch

from sp_runtime.families.flux import PATCH, REF_METHODS, load_model
from sp_runtime.sp.tokens import TokenGrid, as_list, grid_ids, reference_pack, reference_placements, reference_unpack
from sp_lab.references import as_model


def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      y: Optional[torch.Tensor] = None, guidance: Optional[torch.Tensor] = None, ref_latents=None,
                      ref_latents_method: Optional[str] = None, dtype: str = "default", **_ignored) -> torch.Tensor:
    """ComfyUI's Flux diffusion_model(...) computed by diffusers' own forward on one process."""
    model = as_model(model_or_path, load_model, dtype)
    compute, device = model.proj_out.weight.dtype, model.proj_out.weight.device
    batch, _, height, width = x.shape
    refs = as_list(ref_latents)
    placements = [(0, 0, 0)] + reference_placements(ref_latents_method or "offset", (height, width),
                                                    [r.shape[-2:] for r in refs], PATCH, REF_METHODS)
    packed, ids = [], []
    for part, (index, row_offset, col_offset) in zip([x, *refs], placements):
        tokens, grid = reference_pack(part.expand(batch, *part.shape[1:]).to(device, compute), PATCH)
        packed.append(tokens)
        ids.append(grid_ids(grid, index, row_offset, col_offset, False, x.dtype, device))
    if model.config.guidance_embeds and guidance is None:
        raise ValueError("diffusers' Flux with guidance embedding needs guidance (ComfyUI passes 3.5 by default)")
    pooled = torch.zeros(batch, model.config.pooled_projection_dim) if y is None else y[:, :model.config.
                                                                                       pooled_projection_dim]
    guidance = None if not model.config.guidance_embeds else guidance.reshape(-1).expand(batch).to(device, compute)
    with torch.no_grad():
        tokens = model(hidden_states=torch.cat(packed, dim=1), encoder_hidden_states=context.to(device, compute),
                       pooled_projections=pooled.expand(batch, -1).to(device, compute),
                       timestep=timestep.reshape(-1).expand(batch).to(device), img_ids=torch.cat(ids),
                       txt_ids=torch.zeros(context.shape[1], 3, device=device), guidance=guidance,
                       return_dict=False)[0]
    grid = TokenGrid.of(height, width, PATCH)
    return reference_unpack(tokens[:, :grid.count], grid).to(x.dtype).cpu()
