"""Single-device references of the Wan variants whose extra inputs are more tokens of the main sequence (the tests'
side, written apart from sp_runtime.families.wan): Bernini-R's in-context latents (in_context_reference_forward) and
SCAIL / SCAIL-2's reference frames, pose tokens and mask streams (scail_reference_forward). Each builds the whole
sequence, its positions and rotary as ComfyUI's WanModel / SCAILWanModel do, and runs diffusers' stock
WanTransformerBlocks over it."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from sp_lab.references.wan import ROPE_THETA, WanSinusoid, _grid_positions, _unpatchify, _whole_rotary, wrap_pad


def _embed(conv, latent: torch.Tensor) -> torch.Tensor:
    """A Conv3d patch embedding in float32 as ComfyUI runs it, flattened to tokens [B, n, dim]."""
    out = F.conv3d(latent.float(), conv.weight.float(), conv.bias.float(), stride=conv.stride)
    return out.flatten(2).transpose(1, 2)


def _turned(rotary, turns: torch.Tensor):
    """diffusers' cos / sin [1, n, 1, D] with every pair's angle increased by turns[token] x theta^(-2 pair / D)
    (ComfyUI's source-id rotation, composed as 2x2 rotation matrices)."""
    cos, sin = rotary
    dim = cos.shape[-1]
    pairs = torch.arange(dim // 2, dtype=torch.float64) * 2 / dim
    angle = (turns.double()[:, None] * ROPE_THETA ** -pairs[None]).repeat_interleave(2, dim=1)[None, :, None]
    return cos * angle.cos() - sin * angle.sin(), sin * angle.cos() + cos * angle.sin()


def _whole_forward(model, hidden, positions, timestep, context, clip_fea=None, turns=None):
    """diffusers' condition embedder, stock blocks and head over the whole sequence [B, S, dim] at positions [S, 3]."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor
    compute, device = model.scale_shift_table.dtype, model.scale_shift_table.device
    rotary = _whole_rotary(model.rope, positions)
    if turns is not None:
        rotary = _turned(rotary, turns)
    rotary = tuple(part.float().to(device) for part in rotary)
    saved = model.attn_processors, model.condition_embedder.timesteps_proj
    model.set_attn_processor(WanAttnProcessor())
    model.condition_embedder.timesteps_proj = WanSinusoid(model.config.freq_dim)
    try:
        with torch.no_grad():
            image = None if clip_fea is None else clip_fea.to(device, compute)
            temb, projection, text, image = model.condition_embedder(timestep.float().to(device),
                                                                     context.to(device, compute), image)
            if image is not None:
                text = torch.cat([image, text], dim=1)
            hidden = hidden.to(device, compute)
            for block in model.blocks:
                hidden = block(hidden, text, projection.unflatten(1, (6, -1)), rotary)
            shift, scale = (model.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
            hidden = model.norm_out(hidden.float()) * (1 + scale) + shift
            return model.proj_out(hidden.to(compute))
    finally:
        model.set_attn_processor(saved[0])
        model.condition_embedder.timesteps_proj = saved[1]


def in_context_reference_forward(model, x, timestep, context, context_latents=(), **_ignored):
    """ComfyUI's WanModel with context_latents: each latent's tokens after the video's at a grid of its own, its
    rotary turned by source id i + 1; only the video's tokens are output."""
    patch, batch = tuple(model.config.patch_size), x.shape[0]
    latent = wrap_pad(x, patch)
    tokens, positions, turns = [_embed(model.patch_embedding, latent)], [_grid_positions(
        [n // p for n, p in zip(latent.shape[2:], patch)])], [torch.zeros(0)]
    turns[0] = torch.zeros(len(positions[0]))
    for source, extra in enumerate(context_latents, start=1):
        extra = wrap_pad(extra, patch).expand(batch, -1, -1, -1, -1)
        tokens.append(_embed(model.patch_embedding, extra))
        positions.append(_grid_positions([n // p for n, p in zip(extra.shape[2:], patch)]))
        turns.append(torch.full((len(positions[-1]),), float(source)))
    hidden = torch.cat(tokens, dim=1).to(model.scale_shift_table.dtype)
    out = _whole_forward(model, hidden, torch.cat(positions), timestep, context, turns=torch.cat(turns))
    grid = [n // p for n, p in zip(latent.shape[2:], patch)]
    video = _unpatchify(out[:, :len(positions[0])], grid, patch)
    return video[:, :, :x.shape[2], :x.shape[3], :x.shape[4]].to(x.dtype).cpu()


def _stretched_positions(frames: int, rows: int, cols: int, t_start: float, h_start: float, w_start: float,
                         h_scale: float, w_scale: float) -> torch.Tensor:
    """ComfyUI's rope_encode grid with rope options: linspace(start, start + (len - 1) x scale, len) per axis."""
    axes = [torch.linspace(start, start + (n - 1) * scale, n, dtype=torch.float64)
            for start, n, scale in ((t_start, frames, 1.0), (h_start, rows, h_scale), (w_start, cols, w_scale))]
    return torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)


def scail_reference_forward(model, x, timestep, context, clip_fea=None, reference_latent=None, pose_latents=None,
                            ref_mask_latents=None, sam_latents=None, ref_mask_flag=None, **_ignored):
    """ComfyUI's SCAILWanModel / SCAIL2WanModel: [reference frames + video (+ the mask stream), pose (+ its mask)]
    over the whole sequence; the video's tokens output."""
    patch = tuple(model.config.patch_size)
    t, h, w = x.shape[2:]
    main = x if reference_latent is None else torch.cat([reference_latent, x], dim=2)
    refs = main.shape[2] - t
    hidden = _embed(model.patch_embedding, wrap_pad(main, patch))
    if ref_mask_latents is not None:
        hidden = hidden + _embed(model.patch_embedding_mask, wrap_pad(ref_mask_latents, patch))
    grid = [n // p for n, p in zip(wrap_pad(main, patch).shape[2:], patch)]
    replacement = ref_mask_flag is not None and not bool(ref_mask_flag)
    video_start = max(refs - 1, 0) if replacement else refs
    if replacement:
        positions = [_stretched_positions(refs, grid[1], grid[2], 0, 120.0, 0, 1, 1),
                     _stretched_positions(t, grid[1], grid[2], video_start, 0, 0, 1, 1)]
    else:
        positions = [_stretched_positions(refs + t, grid[1], grid[2], 0, 0, 0, 1, 1)]
    tokens = [hidden]
    if pose_latents is not None:
        pose = wrap_pad(pose_latents, patch)
        pose_tokens = _embed(model.patch_embedding_pose, pose)
        if sam_latents is not None:
            pose_tokens = pose_tokens + _embed(model.patch_embedding_mask, wrap_pad(sam_latents, patch))
        tokens.append(pose_tokens)
        h_scale, w_scale = h / pose.shape[3], w / pose.shape[4]
        positions.append(_stretched_positions(pose.shape[2], pose.shape[3] // patch[1], pose.shape[4] // patch[2],
                                              video_start, (h_scale - 1) / 2, 120.0 + (w_scale - 1) / 2,
                                              h_scale, w_scale))
    dtype = model.scale_shift_table.dtype
    out = _whole_forward(model, torch.cat(tokens, dim=1).to(dtype), torch.cat(positions), timestep, context, clip_fea)
    video = _unpatchify(out[:, :hidden.shape[1]], grid, patch)[:, :, refs:]
    return video[:, :, :t, :h, :w].to(x.dtype).cpu()
