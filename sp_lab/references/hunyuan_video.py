"""HunyuanVideo 1.0's single-device reference (tests): diffusers' stock forward, ComfyUI's call convention around
it; reference_latent_hooks gives diffusers' HunyuanVideo 1.0 / 1.5 ComfyUI's reference latent."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch


def reference_forward(model, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor, y: torch.Tensor,
                      guidance: Optional[torch.Tensor] = None, guiding_frame_index=None,
                      ref_latent: Optional[torch.Tensor] = None, **_ignored) -> torch.Tensor:
    """ComfyUI's HunyuanVideo diffusion_model(...) computed by diffusers' own forward and processors on one process
    (ref_latent under reference_latent_hooks).

    Where diffusers' forward follows Tencent rather than ComfyUI, this equals ComfyUI only when: no padding mask
    (the refiner's pooled text), no guidance embedding with token replace, and frames after the first (diffusers'
    final layer ignores the token-replace modulation).
    """
    compute, device = model.proj_out.weight.dtype, model.proj_out.weight.device
    batch = x.shape[0]
    guidance = None if guidance is None else guidance.reshape(-1).expand(batch).to(device, torch.float32) * 1000
    if model.config.guidance_embeds and guidance is None:
        raise ValueError("diffusers' HunyuanVideo with a guidance embedding needs guidance")
    if (guiding_frame_index is not None) != (model.config.image_condition_type == "token_replace"):
        raise ValueError("build the reference with image_condition_type='token_replace' exactly for calls with "
                         "guiding_frame_index")
    if guiding_frame_index is not None and bool((guiding_frame_index != 0).any()):
        raise ValueError("diffusers' token replace embeds timestep 0 for the first frame: guiding_frame_index 0 only")
    with torch.no_grad(), reference_latent_hooks(model, x, ref_latent):
        out = model(hidden_states=x.to(device, compute), timestep=timestep.reshape(-1).expand(batch).to(device),
                    encoder_hidden_states=context.to(device, compute),
                    encoder_attention_mask=torch.ones(batch, context.shape[1], device=device),
                    pooled_projections=y[:, :model.config.pooled_projection_dim].to(device, compute),
                    guidance=guidance, return_dict=False)[0]
    return out.to(x.dtype).cpu()


@contextmanager
def reference_latent_hooks(model, x: torch.Tensor, reference: Optional[torch.Tensor]):
    """For the single-process references (tests): diffusers' HunyuanVideo 1.0 / 1.5 have no reference latent, so
    while this context is open, hooks on their x_embedder, rope and proj_out put the reference's patch embeddings
    ahead of the video's, their rotary angles (ComfyUI's positions, through diffusers' own 1-D rotary) ahead of the
    video's, and drop them before the output projection. No reference: no hooks."""
    if reference is None:
        yield
        return
    from diffusers.models.embeddings import get_1d_rotary_pos_embed
    config, weight = model.config, model.proj_out.weight
    patch = (config.patch_size_t, config.patch_size, config.patch_size)
    sizes = [[size // p for size, p in zip(latent.shape[2:], patch)] for latent in (reference, x)]
    axes = [torch.meshgrid(*(torch.arange(n, dtype=torch.float32) for n in grid), indexing="ij") for grid in sizes]
    axes[0] = (torch.full_like(axes[0][0], -1.0), axes[0][1], axes[0][2] + sizes[1][2])  # ComfyUI's placement
    positions = [torch.cat([grid[axis].flatten() for grid in axes]) for axis in range(3)]
    freqs = [get_1d_rotary_pos_embed(dim, where, config.rope_theta, use_real=True)
             for dim, where in zip(config.rope_axes_dim, positions)]
    rope = tuple(torch.cat([f[part] for f in freqs], dim=1).to(weight.device) for part in (0, 1))
    lead = sizes[0][0] * sizes[0][1] * sizes[0][2]
    with torch.no_grad():
        ahead = model.x_embedder(reference.expand(x.shape[0], *reference.shape[1:]).to(weight.device, weight.dtype))
    hooks = [model.x_embedder.register_forward_hook(lambda _m, _a, out: torch.cat([ahead, out], dim=1)),
             model.rope.register_forward_hook(lambda _m, _a, _out: rope),
             model.proj_out.register_forward_pre_hook(lambda _m, args: (args[0][:, lead:],))]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
