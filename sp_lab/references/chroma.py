"""Chroma single-device reference: diffusers' stock ChromaTransformer2DModel forward fed ComfyUI's
`diffusion_model(x, timestep, context, guidance, attention_mask)` with ComfyUI's packing (2x2 patches, wrap-around
padding, image ids (0, row, col), text ids 0). Written apart from the plan on purpose: diffusers' forward embeds
guidance 0 always, so another guidance is fed by swapping its guidance embedder's input; a text padding mask by
leaving the masked tokens out (the text sits at position 0, so a key mask is the same as fewer tokens)."""
from __future__ import annotations

from typing import Optional

import torch

from sp_runtime.sp.tokens import grid_ids, reference_pack, reference_unpack

PATCH = 2


class _Guidance(torch.nn.Module):
    """diffusers' guidance Timesteps module, given ComfyUI's guidance (times 1000) instead of 0."""

    def __init__(self, stock, guidance: torch.Tensor):
        super().__init__()
        self.stock, self.guidance = stock, guidance

    def forward(self, zeros):
        return self.stock(self.guidance.to(zeros.device) * 1000)


def reference_forward(model, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      guidance: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                      **_ignored) -> torch.Tensor:
    batch = x.shape[0]
    if attention_mask is not None:  # item by item, each with its kept text tokens
        keep = attention_mask.expand(batch, -1).bool()
        return torch.cat([reference_forward(model, x[i:i + 1], timestep.reshape(-1).expand(batch)[i:i + 1],
                                            context.expand(batch, -1, -1)[i:i + 1, keep[i]],
                                            None if guidance is None else guidance.reshape(-1).expand(batch)[i:i + 1])
                          for i in range(batch)])
    radiance = getattr(model, "radiance", None)
    if radiance is not None:  # Chroma Radiance: the trunk below, then its NeRF head
        from .chroma_radiance import radiance_forward
        return radiance_forward(model, x, timestep, context, guidance, radiance)
    weight = model.proj_out.weight
    compute, device = weight.dtype, weight.device
    tokens, grid = reference_pack(x.to(device, compute), PATCH)
    ids = grid_ids(grid, 0, 0, 0, False, x.dtype, device)
    out = stock_forward(model, tokens, ids, torch.zeros(context.shape[1], 3, device=device), context, timestep,
                        guidance)
    return reference_unpack(out, grid).to(x.dtype).cpu()


def stock_forward(model, tokens: torch.Tensor, ids: torch.Tensor, text_ids: torch.Tensor, context: torch.Tensor,
                  timestep: torch.Tensor, guidance: Optional[torch.Tensor]) -> torch.Tensor:
    """diffusers' forward of the model on packed tokens [B, N, F] (ComfyUI's guidance fed to its embedder)."""
    batch, device, compute = tokens.shape[0], tokens.device, tokens.dtype
    embed = model.time_text_embed
    stock = embed.guidance_proj
    if guidance is not None:
        embed.guidance_proj = _Guidance(stock, guidance.reshape(-1).expand(batch).float())
    try:
        with torch.no_grad():
            return model(hidden_states=tokens,
                         encoder_hidden_states=context.expand(batch, -1, -1).to(device, compute),
                         timestep=timestep.reshape(-1).expand(batch).to(device), img_ids=ids, txt_ids=text_ids,
                         return_dict=False)[0]
    finally:
        embed.guidance_proj = stock
