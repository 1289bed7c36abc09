"""Lumina 2's single-device reference (tests): diffusers' stock forward, fed ComfyUI's call in its own convention;
NewBie's pooled text joined to diffusers' time embedding as ComfyUI's NextDiT does."""
from __future__ import annotations

from contextlib import contextmanager

import torch

from sp_runtime.families.lumina2 import PATCH, load_model
from sp_lab.references import as_model


def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      dtype: str = "default", clip_text_pooled=None, **_ignored) -> torch.Tensor:
    """ComfyUI's Lumina 2 diffusion_model(...) computed by diffusers' own forward on one process: every caption token
    attended (ComfyUI's NextDiT reads past attention_mask), t = 1 - sigma, the latent padded to the patch by
    wrap-around (ComfyUI's circular padding), output negated. NewBie: every modulation reads
    time_text_embed(cat(t embedding, clip_text_pooled_proj(pooled) or zeros))."""
    model = as_model(model_or_path, load_model, dtype)
    weight = model.x_embedder.weight
    compute, device = weight.dtype, weight.device
    height, width = x.shape[-2:]
    padded = torch.cat([x, x[:, :, :height % PATCH]], dim=2)
    padded = torch.cat([padded, padded[:, :, :, :width % PATCH]], dim=3)
    context = context.expand(x.shape[0], -1, -1).to(device, compute)
    sigma = timestep.reshape(-1).expand(x.shape[0]).float()
    every_token = torch.ones(context.shape[:2], dtype=torch.bool, device=device)
    with torch.no_grad(), _newbie_time(model, clip_text_pooled, x.shape[0]):
        out = model(padded.to(device, compute), (1 - sigma).to(device), context, every_token, return_dict=False)[0]
    return -out[:, :, :height, :width].to(x.dtype).cpu()


@contextmanager
def _newbie_time(model, pooled, batch: int):
    """For a NewBie model, diffusers' time_caption_embed returns the joined embedding in place of its time one."""
    if getattr(model, "time_text_embed", None) is None:
        yield
        return
    stock = model.time_caption_embed.forward

    def joined(hidden_states, timestep, encoder_hidden_states):
        time, caption = stock(hidden_states, timestep, encoder_hidden_states)
        if pooled is None:
            extra = time.new_zeros(batch, model.clip_text_pooled_proj[0].weight.shape[0])
        else:
            extra = model.clip_text_pooled_proj(pooled.to(time.device, time.dtype)).expand(batch, -1)
        return model.time_text_embed(torch.cat([time, extra], dim=1)), caption
    model.time_caption_embed.forward = joined
    try:
        yield
    finally:
        del model.time_caption_embed.forward
