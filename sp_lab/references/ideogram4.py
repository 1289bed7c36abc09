"""Ideogram 4's single-device reference (tests): diffusers' stock Ideogram4Transformer2DModel forward fed ComfyUI's
call as its Ideogram4Transformer2DModel packs it ([text | image] rows, per-token indicators, (t, h, w) positions,
one segment), written apart from the plan (diffusers' own MRoPE, rotate_half and masking)."""
from __future__ import annotations

import torch

from sp_runtime.families.ideogram4 import load_model
from sp_lab.references import as_model

OFFSET, TEXT, IMAGE = 65536, 3, 2  # diffusers' IMAGE_POSITION_OFFSET, LLM_TOKEN_INDICATOR, OUTPUT_IMAGE_INDICATOR


def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, context=None, dtype: str = "default",
                      **_ignored) -> torch.Tensor:
    model = as_model(model_or_path, load_model, dtype)
    weight = model.input_proj.weight
    compute, device = weight.dtype, weight.device
    batch, channels, height, width = x.shape
    image = x.reshape(batch, channels // 4, 2, 2, height, width).permute(0, 4, 5, 2, 3, 1).reshape(
        batch, height * width, channels)
    text_len = 0 if context is None else context.shape[1]
    length = text_len + height * width
    hidden = torch.zeros(batch, length, channels)
    hidden[:, text_len:] = image
    features = torch.zeros(batch, length, model.config.llm_features_dim)
    if context is not None:
        features[:, :text_len] = context.expand(batch, -1, -1)
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    image_pos = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3) + OFFSET
    text_pos = torch.arange(text_len)[:, None].expand(-1, 3)
    positions = torch.cat([text_pos, image_pos]).expand(batch, -1, -1)
    indicator = torch.full((batch, length), IMAGE)
    indicator[:, :text_len] = TEXT
    sigma = timestep.reshape(-1).expand(batch).float()
    with torch.no_grad():
        out = model(hidden.to(device, compute), (1 - sigma).to(device), features.to(device, compute),
                    positions.to(device), torch.ones(batch, length, dtype=torch.long, device=device),
                    indicator.to(device), return_dict=False)[0]
    out = out[:, text_len:].float().cpu().reshape(batch, height, width, 2, 2, channels // 4)
    return -out.permute(0, 5, 3, 4, 1, 2).reshape(x.shape).to(x.dtype)
