"""ERNIE-Image's single-device reference (tests): diffusers' stock ErnieImageTransformer2DModel forward fed ComfyUI's
call `diffusion_model(x, timesteps, context)`: the timestep as ComfyUI passes it (sigma x 1000), the context of every
item counted whole (ComfyUI's model reads no mask: text_lens = L)."""
from __future__ import annotations

import torch

from sp_runtime.families.ernie_image import load_model
from sp_lab.references import as_model


def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      dtype: str = "default", **_ignored) -> torch.Tensor:
    model = as_model(model_or_path, load_model, dtype)
    weight = model.final_linear.weight
    compute, device = weight.dtype, weight.device
    batch = x.shape[0]
    text = context.expand(batch, -1, -1).to(device, compute)
    lengths = torch.full((batch,), context.shape[1], device=device)
    with torch.no_grad():
        out = model(x.to(device, compute), timestep.reshape(-1).expand(batch).to(device), text, lengths,
                    return_dict=False)[0]
    return out.to(x.dtype).cpu()
