"""Chroma Radiance single-device reference, from ComfyUI's math (comfy/ldm/chroma_radiance), written apart from the
product's modules and plan: diffusers' stock Chroma forward for the trunk on pixel patches (wrap-around padding,
F.unfold features (c, ph, pw), ids (0, row, col), text ids 0 or (i, 0, 0) with `sequential_text_ids`), its final
layer left out; then the NeRF head with einsum over all patches at once: the DCT basis in float64 loops,
L2-normalised generated weights, RMSNorm by hand (epsilon: the dtype's), F.fold into the padded image, the 3x3
convolution with F.conv2d, the crop, and for x0 files (x - x0) / sigma. Reads only the model's weights
(model.radiance: the head's facts)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from sp_runtime.sp.tokens import grid_ids, reference_pack


class _Keep(torch.nn.Module):
    """Stands in for the final norm (diffusers' forward calls norm_out(hidden, temb)) and projection Radiance lacks."""

    def forward(self, hidden, *_):
        return hidden


def radiance_forward(model, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor, guidance, radiance
                     ) -> torch.Tensor:
    from .chroma import stock_forward
    weight = model.x_embedder.weight
    compute, device = weight.dtype, weight.device
    patch, batch = radiance.pixel_patch, x.shape[0]
    tokens, grid = reference_pack(x.to(device, compute), patch)
    ids = grid_ids(grid, 0, 0, 0, False, x.dtype, device)
    text_ids = torch.zeros(context.shape[1], 3, device=device)
    if radiance.sequential_text_ids:
        text_ids[:, 0] = torch.arange(context.shape[1], device=device)
    model.norm_out, model.proj_out = _Keep(), _Keep()
    try:
        hidden = stock_forward(model, tokens, ids, text_ids, context, timestep, guidance)  # [B, N, width]
    finally:
        del model.norm_out, model.proj_out
    with torch.no_grad():
        out = _head(model, radiance, tokens, hidden, grid)
    out = out[:, :, :grid.height, :grid.width].float()
    if radiance.x0:
        sigma = timestep.reshape(-1).expand(batch).float().to(device)
        out = (x.to(device).float() - out) / sigma[:, None, None, None]
    return out.to(x.dtype).cpu()


def _basis(patch: int, freqs: int) -> torch.Tensor:
    """[P*P, F*F]: pixel (y, x) row-major, feature (u, v) = cos(pi x u) cos(pi y v) / (1 + u v)."""
    basis = torch.empty(patch * patch, freqs * freqs, dtype=torch.float64)
    for y in range(patch):
        for x in range(patch):
            for u in range(freqs):
                for v in range(freqs):
                    px, py = x / (patch - 1), y / (patch - 1)
                    basis[y * patch + x, u * freqs + v] = (math.cos(math.pi * px * u) * math.cos(math.pi * py * v)
                                                           / (1 + u * v))
    return basis.float()


def _rms(values: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm with the epsilon of the values' dtype (ComfyUI's RMSNorm leaves torch's default)."""
    return values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + torch.finfo(values.dtype).eps) * weight


def _head(model, radiance, tokens: torch.Tensor, hidden: torch.Tensor, grid) -> torch.Tensor:
    batch, count, _ = tokens.shape
    patch, width, ratio = radiance.pixel_patch, radiance.nerf_hidden_size, radiance.nerf_mlp_ratio
    channels = tokens.shape[-1] // (patch * patch)
    pixels = tokens.reshape(batch, count, channels, patch * patch).transpose(-1, -2).float()  # [B, N, P*P, C]
    basis = _basis(patch, radiance.nerf_max_freqs).to(tokens.device).expand(batch, count, -1, -1)
    embedder = model.nerf_image_embedder.embedder[0]
    h = F.linear(torch.cat([pixels, basis], -1), embedder.weight.float(), embedder.bias.float()).to(hidden.dtype)
    inner = width * ratio
    for block in model.nerf_blocks:
        params = F.linear(hidden, block.param_generator.weight, block.param_generator.bias)
        gate = params[..., :width * inner].reshape(batch, count, width, inner)
        value = params[..., width * inner:2 * width * inner].reshape(batch, count, width, inner)
        down = params[..., 2 * width * inner:].reshape(batch, count, inner, width)
        gate, value, down = (m / m.norm(dim=-2, keepdim=True).clamp_min(1e-12) for m in (gate, value, down))
        y = _rms(h, block.norm.weight)
        mixed = F.silu(torch.einsum("bnpi,bnio->bnpo", y, gate)) * torch.einsum("bnpi,bnio->bnpo", y, value)
        h = h + torch.einsum("bnpo,bnow->bnpw", mixed, down)
    columns = h.permute(0, 3, 2, 1).reshape(batch, width * patch * patch, count)  # fold's (c, kh, kw) rows
    image = F.fold(columns, (grid.rows * patch, grid.cols * patch), kernel_size=patch, stride=patch)
    final = getattr(model, "nerf_final_layer_conv", None) or model.nerf_final_layer
    normed = _rms(image.movedim(1, -1), final.norm.weight)
    if hasattr(final, "conv"):
        return F.conv2d(normed.movedim(-1, 1), final.conv.weight, final.conv.bias, padding=1)
    return F.linear(normed, final.linear.weight, final.linear.bias).movedim(-1, 1)
