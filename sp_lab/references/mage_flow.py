"""Mage-Flow's single-device reference (tests, demo, benchmarks): a plain forward over diffusers' Qwen-Image blocks
written from ComfyUI's MageFlowTransformer2DModel (diffusers has no Mage-Flow class): one token per latent pixel,
references at rotary index 1 .. N, rows and columns centred at -ceil(n / 2), the text at position 0."""
from __future__ import annotations

from typing import Optional

import torch

from sp_runtime.families.mage_flow import load_model
from sp_lab.references import as_model

THETA = 10000


def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      attention_mask: Optional[torch.Tensor] = None, ref_latents=None, dtype: str = "default",
                      **_ignored) -> torch.Tensor:
    """ComfyUI's Mage-Flow diffusion_model(x [B, C, H, W], timestep, context, attention_mask, ref_latents) on one
    process (ref_latents_method is ignored, as ComfyUI's model ignores it)."""
    model = as_model(model_or_path, load_model, dtype)
    compute, device = model.proj_out.weight.dtype, model.proj_out.weight.device
    batch, _, height, width = x.shape
    latents = [x, *(ref_latents or [])]
    tokens = torch.cat([latent.expand(batch, *latent.shape[1:]).flatten(2).transpose(1, 2) for latent in latents],
                       dim=1).to(device, compute)
    ids = torch.cat([_pixel_ids(index, *latent.shape[-2:]) for index, latent in enumerate(latents)])
    axes = model.config.axes_dims_rope
    rotary = (_frequencies(ids, axes).to(device), _frequencies(torch.zeros(context.shape[1], 3), axes).to(device))
    with torch.no_grad():
        image = model.img_in(tokens)
        text = model.txt_in(model.txt_norm(context.to(device, compute)))
        temb = model.time_text_embed(timestep.reshape(-1).expand(batch).to(device, compute), image)
        mask = _text_mask(attention_mask, device)
        for block in model.transformer_blocks:
            text, image = block(hidden_states=image, encoder_hidden_states=text, encoder_hidden_states_mask=mask,
                                temb=temb, image_rotary_emb=rotary)
        out = model.proj_out(model.norm_out(image, temb))[:, :height * width]
    return out.transpose(1, 2).reshape(batch, -1, height, width).to(x.dtype).cpu()


def _pixel_ids(index: int, rows: int, cols: int) -> torch.Tensor:
    """(index, row, column) of each pixel, rows and columns from -ceil(n / 2)."""
    row = torch.arange(rows, dtype=torch.float32) - (rows - rows // 2)
    col = torch.arange(cols, dtype=torch.float32) - (cols - cols // 2)
    return torch.stack([torch.full((rows, cols), float(index)), row[:, None].expand(rows, cols),
                        col[None, :].expand(rows, cols)], dim=-1).reshape(-1, 3)


def _frequencies(ids: torch.Tensor, axes) -> torch.Tensor:
    """Complex rotations [n, head / 2] of consecutive pairs, axis by axis (ComfyUI's EmbedND at theta 10000)."""
    parts = []
    for axis, dim in enumerate(axes):
        inverse = 1.0 / THETA ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angles = ids[:, axis].double()[:, None] * inverse[None, :]
        parts.append(torch.polar(torch.ones_like(angles), angles).to(torch.complex64))
    return torch.cat(parts, dim=1)


def _text_mask(mask: Optional[torch.Tensor], device) -> Optional[torch.Tensor]:
    """ComfyUI's mask (1 keep / 0 pad, or additive 0 / -inf) as diffusers' keep-mask."""
    if mask is None:
        return None
    mask = mask.to(device)
    return (mask == 0) if mask.is_floating_point() and bool((mask < 0).any()) else mask != 0
