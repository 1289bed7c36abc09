"""ComfyUI's `rope_options` (ScaleROPE: scale_x / shift_x, scale_y / shift_y, scale_t / shift_t) applied to the rotary
positions a family already computes, and rotary factors for such (fractional) positions. Shared by the families whose
ComfyUI model reads rope_options; the host sends the options as the per-call input `rope_options`.
"""
from __future__ import annotations

from typing import Optional

import torch

# ComfyUI's option suffix of each position axis, in the (frame, row, col) order of a video grid's positions
VIDEO_AXES = ("t", "y", "x")


def scaled_positions(positions: torch.Tensor, rope_options: Optional[dict], axes=VIDEO_AXES,
                     starts=(0, 0, 0)) -> torch.Tensor:
    """[n, len(axes)] positions as ComfyUI places them under rope_options: start + shift + (p - start) * scale per
    axis (its linspace from start + shift over (len - 1) * scale), in float64. Unchanged (as float64) without
    options."""
    out = positions.to(torch.float64)
    for axis, name in enumerate(axes):
        if not rope_options:
            break
        scale = float(rope_options.get(f"scale_{name}", 1.0))
        shift = float(rope_options.get(f"shift_{name}", 0.0))
        out[:, axis] = starts[axis] + shift + (out[:, axis] - starts[axis]) * scale
    return out


def rotary_axis(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [n, dim] (pairs interleaved) of positions on one axis of `dim` rotary channels, computed in float64 as
    diffusers' get_1d_rotary_pos_embed builds its tables (equal to a table row at an integer position)."""
    inverse = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device)[: dim // 2] / dim))
    angles = torch.outer(positions.to(torch.float64), inverse)
    return (angles.cos().repeat_interleave(2, dim=1).float(), angles.sin().repeat_interleave(2, dim=1).float())


def is_identity(rope_options: Optional[dict]) -> bool:
    """True when the options change no position (absent, or every scale 1 and every shift 0)."""
    if not rope_options:
        return True
    return all(float(value) == (1.0 if key.startswith("scale") else 0.0) for key, value in rope_options.items())
