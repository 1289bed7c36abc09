"""LongCat-Image's single-device reference (tests): diffusers' stock LongCatImageTransformer2DModel forward fed
ComfyUI's Flux call as its LongCatImage model makes it: the latent and references (method "index": reference i at
t = i) padded by wrap-around to 2 x 2 patches, text ids (0, i, i), image ids (t, row, column) moved by the call's
rope_options as ComfyUI's process_img moves them, the output unpacked and cropped. Written apart from the plan."""
from __future__ import annotations

from typing import Optional

import torch

from sp_runtime.sp.tokens import reference_pack


def reference_forward(model, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor, ref_latents=None,
                      ref_latents_method: Optional[str] = None, rope_options: Optional[dict] = None,
                      **_ignored) -> torch.Tensor:
    weight = model.proj_out.weight
    compute, device = weight.dtype, weight.device
    batch, height, width = x.shape[0], x.shape[-2], x.shape[-1]
    if ref_latents and ref_latents_method != "index":
        raise NotImplementedError("the reference places references by the 'index' method only")
    options = rope_options or {}
    pieces, ids = [], []
    for index, latent in enumerate([x, *(ref_latents or ())]):
        tokens, grid = reference_pack(latent.expand(batch, -1, -1, -1).to(device, compute), 2)
        rows, cols = torch.meshgrid(torch.arange(grid.rows), torch.arange(grid.cols), indexing="ij")
        ids.append(torch.stack([torch.full_like(rows, index) + options.get("shift_t", 0.0),
                                rows * options.get("scale_y", 1.0) + options.get("shift_y", 0.0),
                                cols * options.get("scale_x", 1.0) + options.get("shift_x", 0.0)], -1).reshape(-1, 3))
        pieces.append(tokens)
        if index == 0:
            first = grid
    text = torch.arange(context.shape[1], dtype=torch.float32)
    text_ids = torch.stack([torch.zeros_like(text), text, text], -1)
    with torch.no_grad():
        out = model(torch.cat(pieces, 1), context.expand(batch, -1, -1).to(device, compute),
                    timestep.reshape(-1).expand(batch).to(device, compute), torch.cat(ids).float().to(device),
                    text_ids.to(device), return_dict=False)[0]
    out = out[:, :first.count].reshape(batch, first.rows, first.cols, -1, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return out.reshape(batch, -1, 2 * first.rows, 2 * first.cols)[:, :, :height, :width].to(x.dtype).cpu()
