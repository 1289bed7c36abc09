"""SeedVR2's attention windows and their rotary, as index maps over the video's token grid (frame-major).

Windows (ComfyUI's 720pwin / 720pswin "by size"): the grid is scaled to the 720p area (45 x 80 tokens), the scaled
size divided by (4, 3, 3) gives the window size in tokens (frames: at most 30 over 4), and the grid is cut into
windows of that size; odd blocks shift them by half a window on every axis the windows do not cover whole. Rotary
positions are local to each window: the 3B's text-and-video rotary (theta 10000, the text at 0 .. L-1 on all three
axes, the video at (L + frame, row, column)); the 7B's video-only pixel rotary (frequencies linspace(1, 128) x pi,
positions linspace(-1, 1) over the window's extent per axis). Each axis' pairs are consecutive (interleaved), the
head's remaining channels are not rotated."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

REFERENCE_AREA = 45 * 80  # tokens of a 720p frame
MAX_FRAMES = 30
THETA = 10000.0
PIXEL_MAX_FREQUENCY = 256


def window_slices(size: tuple[int, int, int], counts: tuple[int, int, int], shifted: bool) -> list[tuple[slice, ...]]:
    """The windows of a (frames, rows, cols) grid as slices, in ComfyUI's order (columns outermost, frames inner)."""
    frames, rows, cols = size
    scale = math.sqrt(REFERENCE_AREA / (rows * cols))
    extents = (math.ceil(min(frames, MAX_FRAMES) / counts[0]), math.ceil(round(rows * scale) / counts[1]),
               math.ceil(round(cols * scale) / counts[2]))
    axes = [_axis_windows(length, extent, shifted) for length, extent in zip(size, extents)]
    return [(f, r, c) for c in axes[2] for r in axes[1] for f in axes[0]]


def _axis_windows(length: int, extent: int, shifted: bool) -> list[slice]:
    shift = 0.5 if shifted and extent < length else 0
    count = math.ceil((length - shift) / extent) + (1 if shift else 0)
    cuts = [slice(max(int((i - shift) * extent), 0), min(int((i - shift + 1) * extent), length)) for i in range(count)]
    return [cut for cut in cuts if cut.stop > cut.start]


@dataclass
class Windows:
    """One block parity's windows over the grid: members[w] the global token indices of window w (frame-major),
    local[S, 3] each token's position inside its window, extent[S, 3] its window's size."""

    members: list[torch.Tensor]
    local: torch.Tensor
    extent: torch.Tensor


def windows_of(grid: tuple[int, int, int], counts, shifted: bool) -> Windows:
    frames, rows, cols = grid
    index = torch.arange(frames * rows * cols).reshape(frames, rows, cols)
    local = torch.zeros(index.numel(), 3, dtype=torch.long)
    extent = torch.zeros(index.numel(), 3, dtype=torch.long)
    members = []
    for window in window_slices(grid, counts, shifted):
        tokens = index[window]
        shape = tokens.shape
        grids = torch.meshgrid(*(torch.arange(n) for n in shape), indexing="ij")
        flat = tokens.reshape(-1)
        local[flat] = torch.stack([g.reshape(-1) for g in grids], dim=1)
        extent[flat] = torch.tensor(shape)
        members.append(flat)
    return Windows(members, local, extent)


def language_frequencies(count: int) -> torch.Tensor:
    """The 3B's per-axis frequencies: 1 / 10000^(2i / 2count)."""
    dim = 2 * count
    return 1.0 / (THETA ** (torch.arange(0, dim, 2)[:count].float() / dim))


def pixel_frequencies(count: int) -> torch.Tensor:
    """The 7B's per-axis frequencies: linspace(1, 128, count) x pi."""
    return torch.linspace(1.0, PIXEL_MAX_FREQUENCY / 2, count) * math.pi


def video_angles(windows: Windows, tokens: torch.Tensor, variant: str, count: int, text_len: int) -> torch.Tensor:
    """Rotary angles [n, 3 count] (float32) of the given tokens' window-local positions."""
    local, extent = windows.local[tokens], windows.extent[tokens]
    if variant == "3b":
        positions = local.float() + torch.tensor([float(text_len), 0.0, 0.0])
        frequencies = language_frequencies(count)
    else:
        positions = torch.stack([_pixel_positions(local[:, axis], extent[:, axis]) for axis in range(3)], dim=1)
        frequencies = pixel_frequencies(count)
    return torch.cat([positions[:, axis, None] * frequencies[None] for axis in range(3)], dim=1)


def _pixel_positions(local: torch.Tensor, extent: torch.Tensor) -> torch.Tensor:
    """linspace(-1, 1, extent)[local] per token (ComfyUI's values exactly, one linspace per extent)."""
    out = torch.empty(local.shape, dtype=torch.float32)
    for size in extent.unique().tolist():
        chosen = extent == size
        out[chosen] = torch.linspace(-1, 1, steps=size)[local[chosen]]
    return out


def text_angles(length: int, count: int) -> torch.Tensor:
    """The 3B's text rotary [L, 3 count]: token j at position j on every axis."""
    angles = torch.arange(length).float()[:, None] * language_frequencies(count)[None]
    return angles.repeat(1, 3)


def tables(angles: torch.Tensor, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [n, head_dim] of consecutive pairs (sp.tokens.rotate's form); channels past the angles unrotated."""
    pairs = torch.nn.functional.pad(angles, (0, head_dim // 2 - angles.shape[1]))
    pairs = pairs.repeat_interleave(2, dim=1).to(device)
    return pairs.cos(), pairs.sin()
