"""Krea 2's single-device reference (tests): diffusers' stock forward fed ComfyUI's call (the latent padded by
wrap-around to 2 x 2 patches and packed (c, ph, pw), positions 0 for the text and (0, row, column) for the image,
the context unstacked into its Qwen3-VL layers), the output unpacked and cropped. With reference latents (which
diffusers' forward does not take) the same steps through the model's own modules: references i = 1, 2, ... at
(i, row, column) after the image, modulated by the time embedding of 0 under "index_timestep_zero"."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from sp_runtime.families.krea2 import load_model
from sp_lab.references import as_model


def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      ref_latents=None, ref_latents_method: Optional[str] = None, dtype: str = "default",
                      **_ignored) -> torch.Tensor:
    model = as_model(model_or_path, load_model, dtype)
    weight = model.img_in.weight
    compute, device = weight.dtype, weight.device
    batch, channels, height, width = x.shape
    packed, (rows, cols), positions = _packed(x.to(device, compute), 0)
    config = model.config
    stack = context.expand(batch, -1, -1).to(device, compute).unflatten(-1, (config.num_text_layers,
                                                                               config.text_hidden_dim))
    text_positions = torch.zeros(context.shape[1], 3, device=device)
    timestep = timestep.reshape(-1).expand(batch).to(device)
    refs = list(ref_latents or ()) if ref_latents_method is not None else []
    with torch.no_grad():
        if refs:
            out = _with_refs(model, packed, positions, [ref.to(device, compute).expand(batch, -1, -1, -1)
                                                        for ref in refs],
                             stack, timestep, text_positions, ref_latents_method == "index_timestep_zero")
        else:
            out = model(packed, stack, timestep, torch.cat([text_positions, positions]), return_dict=False)[0]
    out = out.reshape(batch, rows, cols, channels, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(batch, channels, 2 * rows,
                                                                                          2 * cols)
    return out[:, :, :height, :width].to(x.dtype).cpu()


def _packed(latent: torch.Tensor, index: int):
    """[B, C, H, W] -> tokens [B, rows x cols, C x 4] (padded by wrap-around), (rows, cols), positions [n, 3]."""
    batch, channels, height, width = latent.shape
    padded = torch.cat([latent, latent[:, :, :height % 2]], dim=2)
    padded = torch.cat([padded, padded[:, :, :, :width % 2]], dim=3)
    rows, cols = padded.shape[2] // 2, padded.shape[3] // 2
    tokens = padded.reshape(batch, channels, rows, 2, cols, 2).permute(0, 2, 4, 1, 3, 5).reshape(batch, rows * cols,
                                                                                                -1)
    grid = torch.stack(torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij"), -1).reshape(-1, 2)
    positions = torch.cat([torch.full((len(grid), 1), float(index)), grid.float()], 1).to(latent.device)
    return tokens, (rows, cols), positions


def _with_refs(model, packed, positions, refs, stack, timestep, text_positions, zero_refs: bool):
    dtype = packed.dtype
    temb = model.time_embed(timestep, dtype=dtype)
    modulation = model.time_mod_proj(F.gelu(temb, approximate="tanh"))
    text = model.txt_in(model.text_fusion(stack))
    pieces = [_packed(ref, index) for index, ref in enumerate(refs, 1)]
    tokens = torch.cat([text, model.img_in(packed), *(model.img_in(piece[0]) for piece in pieces)], dim=1)
    rotary = model.rotary_emb(torch.cat([text_positions, positions, *(piece[2] for piece in pieces)]))
    if zero_refs:
        zero = model.time_mod_proj(F.gelu(model.time_embed(timestep * 0, dtype=dtype), approximate="tanh"))
        first_ref = text.shape[1] + packed.shape[1]
        modulation = torch.cat([modulation.expand(-1, first_ref, -1),
                                zero.expand(-1, tokens.shape[1] - first_ref, -1)], dim=1)
    for block in model.transformer_blocks:
        tokens = block(tokens, modulation, rotary)
    return model.final_layer(tokens[:, text.shape[1]:text.shape[1] + packed.shape[1]], temb)
