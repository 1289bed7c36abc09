"""Single-device references of the Wan variants whose extra inputs are more tokens of the main sequence (the tests'
side, written apart from sp_runtime.families.wan): Bernini-R's in-context latents (in_context_reference_forward),
SCAIL / SCAIL-2's reference frames, pose tokens and mask streams (scail_reference_forward) and Wan Dancer's music
injection, reference CLIP context and global mode (dancer_reference_forward). Each builds the whole
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


def _whole_forward(model, hidden, positions, timestep, context, clip_fea=None, turns=None, image_prefix=None,
                   after_block=None, head=None):
    """diffusers' condition embedder, stock blocks and head over the whole sequence [B, S, dim] at positions [S, 3];
    image_prefix: image context tokens ahead of clip_fea's, after_block(index, hidden) -> hidden after each block,
    head: (modulation table, projection) in place of scale_shift_table / proj_out."""
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
            if image_prefix is not None:
                image = image_prefix if image is None else torch.cat([image_prefix, image], dim=1)
            if image is not None:
                text = torch.cat([image, text], dim=1)
            hidden = hidden.to(device, compute)
            for index, block in enumerate(model.blocks):
                hidden = block(hidden, text, projection.unflatten(1, (6, -1)), rotary)
                if after_block is not None:
                    hidden = after_block(index, hidden)
            table, proj = head or (model.scale_shift_table, model.proj_out)
            shift, scale = (table + temb.unsqueeze(1)).chunk(2, dim=1)
            hidden = model.norm_out(hidden.float()) * (1 + scale) + shift
            return proj(hidden.to(compute))
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


def _music_features(model, audio_embed: torch.Tensor) -> torch.Tensor:
    """ComfyUI's WanDancerModel music encoder: projection, then layers of rotary self-attention (4 heads, positions
    0..S-1, complex rotation of interleaved pairs) and a GELU feed-forward."""
    music = model.music_projection(audio_embed)
    heads, (batch, length, width) = 4, music.shape
    half = width // heads // 2
    angles = torch.outer(torch.arange(length, dtype=torch.float64), 10000.0 ** (-torch.arange(half) * 2.0 / (2 * half)))
    turn = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)[None, None]

    def rotated(tensor):
        pairs = torch.view_as_complex(tensor.float().reshape(batch, length, heads, half, 2).transpose(1, 2).contiguous())
        return torch.view_as_real(pairs * turn).flatten(-2).to(tensor.dtype)

    for layer in model.music_encoder:
        attention, normed = layer.self_attn, layer.norm1(music)
        q, k = rotated(attention.q_proj(normed)), rotated(attention.k_proj(normed))
        v = attention.v_proj(normed).reshape(batch, length, heads, -1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, length, width)
        music = music + attention.out_proj(out)
        music = music + layer.linear2(F.gelu(layer.linear1(layer.norm2(music))))
    return music


def _music_injection(model, audio_embed, frames: int, tokens: int, scale: float):
    """after_block of ComfyUI's music injector: the video's tokens regrouped into 8 x frames groups, each attending
    to its own stretched music vector."""
    music = _music_features(model, audio_embed)
    width = model.scale_shift_table.shape[-1]
    vectors = F.interpolate(music[:, None], size=(8 * frames, width), mode="bilinear")[:, 0]
    batch, groups = vectors.shape[0], 8 * frames
    layers = [0, 4, 8, 12, 16, 20, 24, 27][:len(model.music_injector.injector)]

    def inject(index, hidden):
        if index not in layers:
            return hidden
        attention = model.music_injector.injector[layers.index(index)]
        grouped = F.layer_norm(hidden[:, :tokens], (width,), eps=1e-6).reshape(batch * groups, tokens // groups, width)
        context = vectors.reshape(batch * groups, 1, width)
        q = attention.norm_q(attention.q(grouped))
        k, v = attention.norm_k(attention.k(context)), attention.v(context)
        heads = [part.unflatten(2, (attention.heads, -1)).transpose(1, 2) for part in (q, k, v)]
        out = F.scaled_dot_product_attention(*heads).transpose(1, 2).reshape(batch, tokens, width)
        return torch.cat([hidden[:, :tokens] + attention.o(out) * scale, hidden[:, tokens:]], dim=1)

    return inject


def dancer_reference_forward(model, x, timestep, context, clip_fea=None, clip_fea_ref=None, audio_embed=None,
                             fps=30, audio_inject_scale=1.0, **_ignored):
    """ComfyUI's WanDancerModel over the whole sequence: fps not rounding to 30 selects patch_embedding_global,
    head_global and frame positions 30 / fps apart (the last at round(30 / fps x T) - 1)."""
    patch, batch = tuple(model.config.patch_size), x.shape[0]
    latent = wrap_pad(x, patch)
    grid = [n // p for n, p in zip(latent.shape[2:], patch)]
    positions = _grid_positions(grid)
    global_mode = int(fps + 0.5) != 30
    if global_mode:
        times = torch.arange(grid[0], dtype=torch.float64) * (30.0 / fps)
        times[-1] = int(30.0 / fps * grid[0] + 0.5) - 1
        positions[:, 0] = times[positions[:, 0].long()]
    hidden = _embed(model.patch_embedding_global if global_mode else model.patch_embedding, latent)
    prefix = None if clip_fea_ref is None else model.img_emb_refimage.proj(clip_fea_ref.expand(batch, -1, -1))
    inject = None if audio_embed is None else _music_injection(model, audio_embed.expand(batch, -1, -1), grid[0],
                                                               hidden.shape[1], audio_inject_scale)
    head = (model.head_global.modulation, model.head_global.head) if global_mode else None
    dtype = model.scale_shift_table.dtype
    out = _whole_forward(model, hidden.to(dtype), positions, timestep, context, clip_fea, image_prefix=prefix,
                         after_block=inject, head=head)
    video = _unpatchify(out, grid, patch)
    return video[:, :, :x.shape[2], :x.shape[3], :x.shape[4]].to(x.dtype).cpu()
