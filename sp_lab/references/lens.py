"""Lens' single-device reference (tests): ComfyUI's LensTransformer2DModel forward written out on ComfyUI's keys
(sp_lab.tiny_models.lens.TinyLens; no diffusers, no product code): one token per latent pixel at (0, row, column),
rows and columns from -ceil(n / 2); the text layers each RMS-normed (1e-5) then txt_in, at max(h // 2, w // 2) + i on
every axis; Flux's timestep embedding of sigma x 1000 (cos, sin); blocks with RMS norms (1e-6), shift / scale / gate
modulation, fused q / k / v, RMS q / k norms (1e-5), rotary pairs, joint attention with the text mask as an additive
bias, SwiGLU MLPs; the final norm's (scale, shift) over a plain LayerNorm."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

THETA = 10000


def reference_forward(model, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      attention_mask: Optional[torch.Tensor] = None, **_ignored) -> torch.Tensor:
    config = model.config
    batch, channels, rows, cols = x.shape
    heads, head = config["num_attention_heads"], config["attention_head_dim"]
    with torch.no_grad():
        image = model.img_in(x.permute(0, 2, 3, 1).reshape(batch, rows * cols, channels).float())
        layers = context.float().reshape(batch, context.shape[1], len(model.txt_norm), -1).unbind(2)
        text = model.txt_in(torch.cat([F.rms_norm(part, part.shape[-1:], norm.weight, 1e-5)
                                       for norm, part in zip(model.txt_norm, layers)], dim=-1))
        embedder = model.time_text_embed.timestep_embedder
        temb = embedder.linear_2(F.silu(embedder.linear_1(_time_features(timestep.float().reshape(-1)))))
        temb = temb.expand(batch, -1)
        rotation = _rotations(_ids(rows, cols, context.shape[1]), config["axes_dims_rope"])
        bias = _key_bias(attention_mask, batch, rows * cols, context.shape[1])
        for block in model.transformer_blocks:
            image, text = _block(block, image, text, temb, rotation, bias, heads, head)
        scale, shift = model.norm_out.linear(F.silu(temb)).chunk(2, dim=-1)
        image = F.layer_norm(image, image.shape[-1:], eps=1e-6) * (1 + scale[:, None]) + shift[:, None]
        out = model.proj_out(image)
    return out.reshape(batch, rows, cols, -1).permute(0, 3, 1, 2).to(x.dtype)


def _time_features(sigma: torch.Tensor) -> torch.Tensor:
    half = 128
    frequencies = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
    angles = (1000 * sigma)[:, None] * frequencies[None]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


def _ids(rows: int, cols: int, text: int) -> torch.Tensor:
    row = torch.arange(rows, dtype=torch.float64) - (rows - rows // 2)
    col = torch.arange(cols, dtype=torch.float64) - (cols - cols // 2)
    image = torch.stack([torch.zeros(rows, cols, dtype=torch.float64), row[:, None].expand(rows, cols),
                         col[None, :].expand(rows, cols)], dim=-1).reshape(-1, 3)
    start = max(rows // 2, cols // 2)
    return torch.cat([image, torch.arange(start, start + text, dtype=torch.float64)[:, None].expand(-1, 3)])


def _rotations(ids: torch.Tensor, axes) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [tokens, head / 2] of consecutive pairs, axis by axis."""
    angles = torch.cat([ids[:, axis, None] / THETA ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
                        for axis, dim in enumerate(axes)], dim=1)
    return angles.cos().float(), angles.sin().float()


def _rotate(t: torch.Tensor, rotation) -> torch.Tensor:
    cos, sin = rotation[0][None, :, None], rotation[1][None, :, None]
    even, odd = t[..., 0::2], t[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def _key_bias(mask: Optional[torch.Tensor], batch: int, image: int, text: int) -> Optional[torch.Tensor]:
    if mask is None:
        return None
    keys = torch.cat([torch.ones(batch, image, dtype=torch.bool), mask.reshape(batch, text).bool()], dim=1)
    bias = torch.zeros(keys.shape).masked_fill(~keys, torch.finfo(torch.float32).min)
    return bias[:, None, None, :]


def _modulate(x: torch.Tensor, params: torch.Tensor):
    shift, scale, gate = params.chunk(3, dim=-1)
    return x * (1 + scale[:, None]) + shift[:, None], gate[:, None]


def _block(block, image, text, temb, rotation, bias, heads: int, head: int):
    img_mod1, img_mod2 = block.img_mod(temb).chunk(2, dim=-1)
    txt_mod1, txt_mod2 = block.txt_mod(temb).chunk(2, dim=-1)
    img_in, img_gate = _modulate(F.rms_norm(image, image.shape[-1:], block.img_norm1.weight, 1e-6), img_mod1)
    txt_in, txt_gate = _modulate(F.rms_norm(text, text.shape[-1:], block.txt_norm1.weight, 1e-6), txt_mod1)
    attn = block.attn
    qkv = []
    for tokens, fused, norm_q, norm_k in ((img_in, attn.img_qkv, attn.norm_q, attn.norm_k),
                                          (txt_in, attn.txt_qkv, attn.norm_added_q, attn.norm_added_k)):
        q, k, v = fused(tokens).view(*tokens.shape[:2], 3, heads, head).unbind(2)
        qkv.append((F.rms_norm(q, (head,), norm_q.weight, 1e-5), F.rms_norm(k, (head,), norm_k.weight, 1e-5), v))
    q, k, v = (torch.cat([qkv[0][i], qkv[1][i]], dim=1) for i in range(3))
    q, k = _rotate(q, rotation), _rotate(k, rotation)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias)
    out = out.transpose(1, 2).flatten(2)
    length = image.shape[1]
    image = image + img_gate * attn.to_out[0](out[:, :length])
    text = text + txt_gate * attn.to_add_out(out[:, length:])
    img_in, img_gate = _modulate(F.rms_norm(image, image.shape[-1:], block.img_norm2.weight, 1e-6), img_mod2)
    image = image + img_gate * _swiglu(block.img_mlp, img_in)
    txt_in, txt_gate = _modulate(F.rms_norm(text, text.shape[-1:], block.txt_norm2.weight, 1e-6), txt_mod2)
    text = text + txt_gate * _swiglu(block.txt_mlp, txt_in)
    return image, text


def _swiglu(mlp, x: torch.Tensor) -> torch.Tensor:
    return mlp.w2(F.silu(mlp.w1(x)) * mlp.w3(x))
