"""HunyuanVideo 1.5's single-device reference (tests): diffusers' stock forward, ComfyUI's call convention around
it (ref_latent through hunyuan_video's reference_latent_hooks)."""
from __future__ import annotations

from typing import Optional

import torch

from .hunyuan_video import reference_latent_hooks


def reference_forward(model, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      txt_byt5: Optional[torch.Tensor] = None, clip_fea: Optional[torch.Tensor] = None,
                      timestep_r: Optional[torch.Tensor] = None, ref_latent: Optional[torch.Tensor] = None,
                      **_ignored) -> torch.Tensor:
    """ComfyUI's HunyuanVideo 1.5 diffusion_model(...) computed by diffusers' own forward on one process; inputs
    ComfyUI leaves out are given to diffusers as fully masked (all-zero image embeddings: text-to-video). diffusers
    has no reference latent: with ref_latent its forward runs under hunyuan_video.reference_latent_hooks."""
    compute, device = model.proj_out.weight.dtype, model.proj_out.weight.device
    batch, config = x.shape[0], model.config
    glyph_mask = torch.ones if txt_byt5 is not None else torch.zeros
    txt_byt5 = torch.zeros(batch, 1, config.text_embed_2_dim) if txt_byt5 is None else txt_byt5
    clip_fea = torch.zeros(batch, 1, config.image_embed_dim) if clip_fea is None else clip_fea
    if timestep_r is not None and config.use_meanflow:  # ComfyUI's models without time_r_in ignore it
        timestep_r = timestep_r.reshape(-1).expand(batch).to(device, compute)
    else:
        timestep_r = None
    # diffusers embeds the timestep in its own dtype: the compute dtype, as its pipeline
    with torch.no_grad(), reference_latent_hooks(model, x, ref_latent):
        out = model(hidden_states=x.to(device, compute),
                    timestep=timestep.reshape(-1).expand(batch).to(device, compute), timestep_r=timestep_r,
                    encoder_hidden_states=context.to(device, compute),
                    encoder_attention_mask=torch.ones(batch, context.shape[1], device=device),
                    encoder_hidden_states_2=txt_byt5.to(device, compute),
                    encoder_attention_mask_2=glyph_mask(batch, txt_byt5.shape[1], device=device),
                    image_embeds=clip_fea.to(device, compute), return_dict=False)[0]
    return out.to(x.dtype).cpu()
