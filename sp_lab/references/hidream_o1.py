"""HiDream-O1's single-device reference (tests): ComfyUI's HiDreamO1Transformer forward written plainly from its facts
on our module's weights (diffusers has no class for it), apart from the plan: the whole sequence at once, an explicit
[T, T] mask (causal before ar_len, full after), grouped-query SDPA, Qwen3-VL's interleaved MRoPE built per axis and
applied split-half (rotate_half), the decoder layers computed from their Linears (not their forward)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from sp_runtime.families.hidream_o1 import load_model
from sp_lab.references import as_model


def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, input_ids=None, position_ids=None,
                      ar_len=None, dtype: str = "default", **_ignored) -> torch.Tensor:
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
        embeds = torch.where((ids == config.tms_token_id)[..., None], t_emb[:, None].expand_as(embeds), embeds)
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
