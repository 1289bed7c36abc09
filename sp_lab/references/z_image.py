"""Z-Image's single-device reference (tests): diffusers' stock forward, fed ComfyUI's call in its own convention."""
from __future__ import annotations

import torch

from sp_runtime.families.z_image import PATCH, load_model


def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      dtype: str = "default", **_ignored) -> torch.Tensor:
    """ComfyUI's Z-Image diffusion_model(...) computed by diffusers' own forward on one process: per-item lists,
    t = 1 - sigma, the latent padded to the patch by wrap-around (ComfyUI's circular padding), output negated."""
    model = model_or_path
    if not isinstance(model, torch.nn.Module):
        model = load_model(model_or_path, dtype)[0]
    weight = model.all_x_embedder[f"{PATCH}-1"].weight
    compute, device = weight.dtype, weight.device
    height, width = x.shape[-2:]
    padded = torch.cat([x, x[:, :, :height % PATCH]], dim=2)
    padded = torch.cat([padded, padded[:, :, :, :width % PATCH]], dim=3)
    context = context.expand(x.shape[0], -1, -1)
    sigma = timestep.reshape(-1).expand(x.shape[0]).float()
    with torch.no_grad():
        outputs = model([item[:, None].to(device, compute) for item in padded], (1 - sigma).to(device),
                        [item.to(device, compute) for item in context], return_dict=False)[0]
    return -torch.stack(outputs)[:, :, 0, :height, :width].to(x.dtype).cpu()
