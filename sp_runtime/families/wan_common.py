"""Pieces shared by the Wan forward (wan.py) and its variants' modules, kept apart so that the variants need not import
wan.py (which imports them): Wan's own timestep sinusoid, the rotary embedding and the references' circular
padding."""
from __future__ import annotations

import torch


def wan_sinusoid(dim: int, timestep: torch.Tensor) -> torch.Tensor:
    """Wan's own sinusoidal_embedding_1d, [cos, sin] of float32 angles, which ComfyUI uses.

    Restated because diffusers' Timesteps rounds its frequencies differently (up to 6e-5 apart at t = 1000, which
    shows in the output at 1e-5 of its scale).
    """
    half = dim // 2
    position = timestep.float()
    angles = torch.outer(position, torch.pow(10000, -torch.arange(half, device=position.device).to(position)
                                             .div(half)))
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=1)


class WanSinusoid(torch.nn.Module):
    """wan_sinusoid as the module diffusers' condition embedder calls (the single-device references)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, timestep: torch.Tensor) -> torch.Tensor:
        return wan_sinusoid(self.dim, timestep)


def wrap_pad(latent: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """Circular padding by concatenating each axis' first entries (written apart from pad_to_patch_3d)."""
    for axis, size in enumerate(patch, start=2):
        extra = (-latent.shape[axis]) % size
        if extra:
            latent = torch.cat([latent, latent.narrow(axis, 0, extra)], dim=axis)
    return latent


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' Wan rotary embedding on interleaved pairs (its processor defines it inline, so it is restated)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)
