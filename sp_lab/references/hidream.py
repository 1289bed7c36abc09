"""HiDream single-device reference: diffusers' stock HiDreamImageTransformer2DModel forward fed ComfyUI's
`diffusion_model(x, t, y, context, encoder_hidden_states_llama3, image_cond)`: E1's image_cond joined on the right
of x, wrap-around padding to whole patches, the output cropped to x and negated, as ComfyUI's HiDream does. diffusers
pads non-square latents to its maximum sequence (keys of the padding zeroed), ComfyUI does not: the patches are fed
already packed, with an all-ones mask. Written apart from the plan on purpose."""
from __future__ import annotations

from typing import Optional

import torch

from sp_runtime.sp.tokens import reference_pack


def reference_forward(model, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      encoder_hidden_states_llama3: torch.Tensor, y: torch.Tensor,
                      image_cond: Optional[torch.Tensor] = None, **_ignored) -> torch.Tensor:
    weight = model.final_layer.linear.weight
    compute, device = weight.dtype, weight.device
    compute = torch.bfloat16 if compute.itemsize == 1 else compute  # fp8 storage computes in bf16 (diffusers' hooks)
    patch, batch = model.config.patch_size, x.shape[0]
    height, width = x.shape[-2:]
    latent = x if image_cond is None else torch.cat([x, image_cond.expand(batch, -1, -1, -1)], dim=-1)
    tokens, grid = reference_pack(latent.to(device, compute), patch)
    tokens = tokens.unflatten(-1, (-1, patch, patch)).permute(0, 1, 3, 4, 2).flatten(2)  # (c, p, p) -> (p, p, c)
    rows, cols = torch.meshgrid(torch.arange(grid.rows), torch.arange(grid.cols), indexing="ij")
    ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(1, -1, 3).float().to(device)
    with torch.no_grad():
        out = model(hidden_states=tokens, timesteps=timestep.reshape(-1).expand(batch).to(device),
                    encoder_hidden_states_t5=context.expand(batch, -1, -1).to(device, compute),
                    encoder_hidden_states_llama3=encoder_hidden_states_llama3.expand(batch, -1, -1, -1)
                    .movedim(1, 0).to(device, compute),
                    pooled_embeds=y.expand(batch, -1).to(device, compute), img_ids=ids.expand(batch, -1, -1),
                    img_sizes=[(grid.rows, grid.cols)] * batch,
                    hidden_states_masks=torch.ones(batch, grid.count, device=device, dtype=compute),
                    return_dict=False)[0]
    return -out[:, :, :height, :width].to(x.dtype).cpu()
