"""LTX-Video 0.9's single-device reference (tests): diffusers' stock forward fed ComfyUI's LTXV call, its token
positions as diffusers' LTX condition pipeline makes them (_prepare_video_ids / _scale_video_ids, which need
transformers to import: a meshgrid of latent indices x (8, 32, 32), the first frame's causal fix) and time / frame
rate, guide tokens at keyframe_idxs."""
from __future__ import annotations

from typing import Optional

import torch

from sp_runtime.families.ltxv import load_model
from sp_lab.references import as_model


def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      attention_mask: Optional[torch.Tensor] = None, frame_rate=25, keyframe_idxs=None,
                      dtype: str = "default", **_ignored) -> torch.Tensor:
    model = as_model(model_or_path, load_model, dtype)
    weight = model.proj_in.weight
    compute, device = weight.dtype, weight.device
    batch, channels, frames, height, width = x.shape
    axes = [torch.arange(size, device=device) for size in (frames, height, width)]
    ids = torch.stack(torch.meshgrid(*axes, indexing="ij")).reshape(1, 3, -1).repeat(batch, 1, 1)
    coords = (ids * torch.tensor([8, 32, 32], device=device)[None, :, None]).float()
    if model.config.get("causal_temporal_positioning", False):
        coords[:, 0] = (coords[:, 0] + 1 - 8).clamp(min=0)
    if keyframe_idxs is not None:
        guides = keyframe_idxs[..., 0] if keyframe_idxs.dim() == 4 else keyframe_idxs
        coords[:, :, -guides.shape[2]:] = guides.to(device).float()
    coords[:, 0] = coords[:, 0] * (1.0 / float(frame_rate))
    scale = model.config.get("timestep_scale_multiplier", 1000.0)
    tokens = x.to(device, compute).flatten(2).transpose(1, 2)
    timestep = timestep.to(device).float().reshape(batch, -1) * scale
    with torch.no_grad():
        out = model(tokens, context.expand(batch, -1, -1).to(device, compute), timestep, attention_mask,
                    video_coords=coords, return_dict=False)[0]
    return out.transpose(1, 2).reshape(batch, -1, frames, height, width).to(x.dtype).cpu()
