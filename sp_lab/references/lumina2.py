"""Lumina 2's single-device reference (tests): diffusers' stock forward, fed ComfyUI's call in its own convention."""
from __future__ import annotations

import torch

from sp_runtime.families.lumina2 import PATCH, load_model
from sp_lab.references import as_model


def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      dtype: str = "default", **_ignored) -> torch.Tensor:
    """ComfyUI's Lumina 2 diffusion_model(...) computed by diffusers' own forward on one process: every caption token
    attended (ComfyUI's NextDiT reads past attention_mask), t = 1 - sigma, the latent padded to the patch by
    wrap-around (ComfyUI's circular padding), output negated."""
    model = as_model(model_or_path, load_model, dtype)
    weight = model.x_embedder.weight
    compute, device = weight.dtype, weight.device
    height, width = x.shape[-2:]
    padded = torch.cat([x, x[:, :, :height % PATCH]], dim=2)
    padded = torch.cat([padded, padded[:, :, :, :width % PATCH]], dim=3)
    context = context.expand(x.shape[0], -1, -1).to(device, compute)
    sigma = timestep.reshape(-1).expand(x.shape[0]).float()
    every_token = torch.ones(context.shape[:2], dtype=torch.bool, device=device)
    with torch.no_grad():
        out = model(padded.to(device, compute), (1 - sigma).to(device), context, every_token, return_dict=False)[0]
    return -out[:, :, :height, :width].to(x.dtype).cpu()
