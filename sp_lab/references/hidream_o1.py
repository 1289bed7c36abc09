"""HiDream-O1's single-device reference (tests): ComfyUI's HiDreamO1Transformer forward written plainly from its facts
on our module's weights (diffusers has no class for it), apart from the plan: the whole sequence at once, an explicit
[T, T] mask (causal before ar_len, full after), grouped-query SDPA, Qwen3-VL's interleaved MRoPE built per axis and
applied split-half (rotate_half), the decoder layers computed from their Linears (not their forward). Reference
images: ref_patches embedded after the image; the vision tower written plainly too (the Conv3d as one matrix, the
position table resized by F.interpolate (bilinear, corners aligned), the merge order by explicit indices, the 2-D
rotary per token, attention within each image through a block-diagonal mask), its rows written over the
<|image_pad|> tokens of row 0."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from sp_runtime.families.hidream_o1 import load_model
from sp_lab.references import as_model

IMAGE_PAD = 151655  # Qwen3-VL <|image_pad|>


def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, input_ids=None, position_ids=None,
                      ar_len=None, dtype: str = "default", ref_patches=None, ref_pixel_values=None,
                      ref_image_grid_thw=None, **_ignored) -> torch.Tensor:
    model = as_model(model_or_path, load_model, dtype)
    config = model.config
    weight = model.final_layer2.linear.weight
    compute, device = weight.dtype, weight.device
    batch, channels, height, width = x.shape
    p = config.patch_size
    rows, cols = height // p, width // p
    x = x.to(device, compute)
    patches = x.reshape(batch, channels, rows, p, cols, p).permute(0, 2, 4, 1, 3, 5).reshape(batch, rows * cols, -1)
    ids = input_ids.to(device).long().expand(batch, -1)
    text = ids.shape[1]
    sigma = timestep.reshape(-1).expand(batch).float().to(device) / 1000.0
    with torch.no_grad():
        embeds = model.embed_tokens(ids).to(compute)
        t_emb = _timestep_mlp(model, (1.0 - sigma) * 1000, compute)
        if ref_pixel_values is not None:
            pixels = ref_pixel_values.to(device, compute)
            grid = ref_image_grid_thw[0] if ref_image_grid_thw.dim() == 3 else ref_image_grid_thw
            images = _vision(model.visual, pixels[0] if pixels.dim() == 3 else pixels, grid.tolist(),
                             config.vision["merge"])
            embeds[:, (ids[0] == IMAGE_PAD).nonzero()[:, 0]] = images.to(compute)
        embeds = torch.where((ids == config.tms_token_id)[..., None], t_emb[:, None].expand_as(embeds), embeds)
        if ref_patches is not None:
            patches = torch.cat([patches, ref_patches.to(device, compute).expand(batch, -1, -1)], dim=1)
        hidden = torch.cat([embeds, model.x_embedder.proj2(model.x_embedder.proj1(patches))], dim=1)
        cos, sin = _mrope(position_ids[0].to(device), config)
        total = hidden.shape[1]
        query_at, key_at = torch.arange(total, device=device)[:, None], torch.arange(total, device=device)[None]
        mask = (query_at >= int(ar_len)) | (key_at <= query_at)
        for layer in model.layers:
            hidden = hidden + _attention(layer.self_attn, layer.input_layernorm(hidden), cos, sin, mask)
            mlp = layer.mlp
            normed = layer.post_attention_layernorm(hidden)
            hidden = hidden + mlp.down_proj(F.silu(mlp.gate_proj(normed)) * mlp.up_proj(normed))
        predicted = model.final_layer2.linear(model.norm(hidden)[:, text:text + rows * cols])
    image = predicted.float().reshape(batch, rows, cols, channels, p, p).permute(0, 3, 1, 4, 2, 5)
    image = image.reshape(batch, channels, height, width)
    out = (x.float() - image) / sigma.view(batch, 1, 1, 1).clamp_min(1e-3)
    return out.cpu()


def _timestep_mlp(model, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    half = 128
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angles = t.float()[:, None] * freqs[None]
    first, _, second = model.t_embedder1.mlp
    return second(F.silu(first(torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype))))


def _mrope(positions: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] of Qwen3-VL's interleaved MRoPE: every frequency from the t axis, except frequencies
    1, 4, 7, ... (h, below 3 x sections[1]) and 2, 5, 8, ... (w, below 3 x sections[2]); halves repeated."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, device=positions.device).float() / dim))
    per_axis = positions.float()[:, :, None] * inv_freq[None, None]   # [3, T, dim / 2]
    angles = per_axis[0].clone()
    for axis in (1, 2):
        picked = slice(axis, 3 * config.mrope_section[axis], 3)
        angles[:, picked] = per_axis[axis][:, picked]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def _attention(attn, hidden, cos, sin, mask) -> torch.Tensor:
    batch, total, _ = hidden.shape
    query = attn.q_norm(attn.q_proj(hidden).view(batch, total, attn.heads, -1)).transpose(1, 2)
    key = attn.k_norm(attn.k_proj(hidden).view(batch, total, attn.kv_heads, -1)).transpose(1, 2)
    value = attn.v_proj(hidden).view(batch, total, attn.kv_heads, -1).transpose(1, 2)
    dtype = query.dtype
    query = (query.float() * cos + _rotate_half(query.float()) * sin).to(dtype)
    key = (key.float() * cos + _rotate_half(key.float()) * sin).to(dtype)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)
    return attn.o_proj(out.transpose(1, 2).reshape(batch, total, -1))


def _vision(tower, pixels: torch.Tensor, grid: list, merge: int) -> torch.Tensor:
    """The vision tower on [N, C T P P] pixel rows of images with grids [[t, h, w], ...] -> [N / merge^2, width]."""
    conv = tower.patch_embed.proj
    x = F.linear(pixels, conv.weight.flatten(1), conv.bias)
    table = tower.pos_embed.weight
    side, width = math.isqrt(table.shape[0]), table.shape[1]
    heads = tower.heads
    quarter = width // heads // 2
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter))
    positions, angles, sizes = [], [], []
    for t, h, w in grid:
        order = [(block_r * merge + r, block_c * merge + c) for block_r in range(h // merge)
                 for block_c in range(w // merge) for r in range(merge) for c in range(merge)]
        rows, cols = (torch.tensor([pair[axis] for pair in order]) for axis in (0, 1))
        resized = F.interpolate(table.reshape(1, side, side, width).permute(0, 3, 1, 2), size=(h, w),
                                mode="bilinear", align_corners=True)[0]
        positions.append(resized[:, rows, cols].t().repeat(t, 1))
        angle = torch.cat([rows[:, None].float() * inv_freq, cols[:, None].float() * inv_freq], dim=-1)
        angles.append(angle.repeat(t, 1))
        sizes += [h * w] * t
    x = x + torch.cat(positions)
    angles = torch.cat(angles)
    angles = torch.cat([angles, angles], dim=-1).to(x.device)
    cos, sin = angles.cos()[None], angles.sin()[None]   # [1, N, head_dim]: heads first below
    mask = torch.block_diag(*[torch.ones(n, n, dtype=torch.bool) for n in sizes]).to(x.device)
    tokens = x.shape[0]
    for block in tower.blocks:
        normed = F.layer_norm(x, (width,), block.norm1.weight, block.norm1.bias, 1e-6)
        qkv = block.attn.qkv(normed).reshape(tokens, 3, heads, -1).permute(1, 2, 0, 3)  # [3, heads, N, d]
        query, key, value = qkv[0], qkv[1], qkv[2]
        query = (query.float() * cos + _rotate_half(query.float()) * sin).to(x.dtype)
        key = (key.float() * cos + _rotate_half(key.float()) * sin).to(x.dtype)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask)
        x = x + block.attn.proj(out.transpose(0, 1).reshape(tokens, width))
        normed = F.layer_norm(x, (width,), block.norm2.weight, block.norm2.bias, 1e-6)
        x = x + block.mlp.linear_fc2(F.gelu(block.mlp.linear_fc1(normed), approximate="tanh"))
    merger = tower.merger
    x = F.layer_norm(x, (width,), merger.norm.weight, merger.norm.bias, 1e-6).reshape(-1, merge * merge * width)
    return merger.linear_fc2(F.gelu(merger.linear_fc1(x)))
