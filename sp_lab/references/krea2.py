"""Krea 2's single-device reference (tests): diffusers' stock forward fed ComfyUI's call (the latent padded by
wrap-around to 2 x 2 patches and packed (c, ph, pw), positions 0 for the text and (0, row, column) for the image,
the context unstacked into its Qwen3-VL layers), the output unpacked and cropped."""
from __future__ import annotations

import torch

from sp_runtime.families.krea2 import load_model
from sp_lab.references import as_model


def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      dtype: str = "default", **_ignored) -> torch.Tensor:
    model = as_model(model_or_path, load_model, dtype)
    weight = model.img_in.weight
    compute, device = weight.dtype, weight.device
    batch, channels, height, width = x.shape
    padded = torch.cat([x, x[:, :, :height % 2]], dim=2)
    padded = torch.cat([padded, padded[:, :, :, :width % 2]], dim=3).to(device, compute)
    rows, cols = padded.shape[2] // 2, padded.shape[3] // 2
    packed = padded.reshape(batch, channels, rows, 2, cols, 2).permute(0, 2, 4, 1, 3, 5).reshape(batch, rows * cols, -1)
    config = model.config
    stack = context.expand(batch, -1, -1).to(device, compute).unflatten(-1, (config.num_text_layers,
                                                                               config.text_hidden_dim))
    grid = torch.stack(torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij"), -1).reshape(-1, 2)
    positions = torch.cat([torch.zeros(context.shape[1], 3), torch.cat([torch.zeros(len(grid), 1), grid], 1)])
    with torch.no_grad():
        out = model(packed, stack, timestep.reshape(-1).expand(batch).to(device), positions.to(device),
                    return_dict=False)[0]
    out = out.reshape(batch, rows, cols, channels, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(batch, channels, 2 * rows,
                                                                                          2 * cols)
    return out[:, :, :height, :width].to(x.dtype).cpu()
