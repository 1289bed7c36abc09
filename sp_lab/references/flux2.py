"""Flux.2's single-device reference (tests, demo): diffusers' stock forward and processors, ComfyUI's ids."""
from __future__ import annotations

from typing import Optional

import torch

from sp_runtime.families.flux2 import DEFAULT_REF_METHOD, PATCH, load_model, placements, text_ids
from sp_runtime.sp.tokens import TokenGrid, as_list, grid_ids
from sp_lab.references import as_model


def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      guidance: Optional[torch.Tensor] = None, ref_latents=None,
                      ref_latents_method: Optional[str] = None, dtype: str = "default", **_ignored) -> torch.Tensor:
    """ComfyUI's Flux.2 diffusion_model(...) computed by diffusers' own forward on one process."""
    model = as_model(model_or_path, load_model, dtype)
    compute, device = model.proj_out.weight.dtype, model.proj_out.weight.device
    batch, _, height, width = x.shape
    refs = as_list(ref_latents)
    found = placements(ref_latents_method or DEFAULT_REF_METHOD, (height, width), [r.shape[-2:] for r in refs])
    packed, ids = [], []
    for part, (index, row_offset, col_offset) in zip([x, *refs], [(0, 0, 0), *found]):
        packed.append(part.expand(batch, *part.shape[1:]).flatten(2).transpose(1, 2).to(device, compute))
        grid = TokenGrid.of(part.shape[-2], part.shape[-1], PATCH)
        three = grid_ids(grid, index, row_offset, col_offset, False, torch.float32, device)
        ids.append(torch.cat([three, torch.zeros(len(three), 1, device=device)], dim=1))
    if not model.config.guidance_embeds:
        guidance = None
    with torch.no_grad():
        tokens = model(hidden_states=torch.cat(packed, dim=1), encoder_hidden_states=context.to(device, compute),
                       timestep=timestep.reshape(-1).expand(batch).to(device), img_ids=torch.cat(ids),
                       txt_ids=text_ids(context.shape[1], device),
                       guidance=None if guidance is None else guidance.reshape(-1).expand(batch).to(device, compute),
                       return_dict=False)[0]
    return tokens[:, :height * width].transpose(1, 2).reshape(x.shape).to(x.dtype).cpu()
