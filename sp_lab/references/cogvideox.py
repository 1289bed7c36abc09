"""CogVideoX's single-device reference (tests): diffusers' stock forward, ComfyUI's call convention around it."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def reference_forward(model, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      ofs: Optional[torch.Tensor] = None, **_ignored) -> torch.Tensor:
    """ComfyUI's CogVideoX diffusion_model(x, timestep, context, ofs) computed by diffusers' forward on one process:
    x [B, C, T, H, W] padded by wrap-around to whole patches (as ComfyUI pads) and fed as diffusers' [B, T, C, H, W],
    the rotary diffusers' pipelines make for 1.5 ("slice" grid), the output cropped back."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed
    config, weight = model.config, model.proj_out.weight
    patch = (config.patch_size_t, config.patch_size, config.patch_size)
    frames, height, width = x.shape[2:]
    pad = [(-size) % p for size, p in zip(x.shape[2:], patch)]
    padded = F.pad(x, (0, pad[2], 0, pad[1], 0, pad[0]), mode="circular") if any(pad) else x
    grid = [size // p for size, p in zip(padded.shape[2:], patch)]
    rotary = get_3d_rotary_pos_embed(config.attention_head_dim, None, (grid[1], grid[2]), grid[0],
                                     grid_type="slice", max_size=(grid[1], grid[2]), device=weight.device)
    batch = x.shape[0]
    if ofs is not None:
        ofs = ofs.reshape(-1).expand(batch).to(weight.device, torch.float32)
    with torch.no_grad():
        out = model(hidden_states=padded.permute(0, 2, 1, 3, 4).to(weight.device, weight.dtype),
                    encoder_hidden_states=context.expand(batch, *context.shape[1:]).to(weight.device, weight.dtype),
                    timestep=timestep.reshape(-1).expand(batch).to(weight.device, torch.float32), ofs=ofs,
                    image_rotary_emb=rotary, return_dict=False)[0]
    return out.permute(0, 2, 1, 3, 4)[:, :, :frames, :height, :width].to(x.dtype).cpu()
