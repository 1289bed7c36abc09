"""SD3 / SD3.5 single-device reference: diffusers' stock SD3Transformer2DModel forward fed ComfyUI's
`diffusion_model(x, timesteps, context, y)` (timesteps already sigma * 1000), the latent padded to whole patches by
wrap-around and the output cropped, as ComfyUI's MMDiT does. Written apart from the plan on purpose."""
from __future__ import annotations

import torch


def reference_forward(model, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor, y: torch.Tensor,
                      **_ignored) -> torch.Tensor:
    weight = model.proj_out.weight
    compute, device = weight.dtype, weight.device
    patch = model.config.patch_size
    height, width = x.shape[-2:]
    padded = torch.cat([x, x[:, :, :(-height) % patch]], dim=2)
    padded = torch.cat([padded, padded[:, :, :, :(-width) % patch]], dim=3)
    batch = x.shape[0]
    with torch.no_grad():
        out = model(hidden_states=padded.to(device, compute),
                    encoder_hidden_states=context.expand(batch, -1, -1).to(device, compute),
                    pooled_projections=y.expand(batch, -1).to(device, compute),
                    timestep=timestep.reshape(-1).expand(batch).to(device), return_dict=False)[0]
    return out[:, :, :height, :width].to(x.dtype).cpu()
