"""3-D token grids of video DiTs (Wan, HunyuanVideo, LTX-2): ComfyUI's circular padding to the patch size, the
patches and (frame, row, column) positions of one rank's token range, and writing that range's output back into the
latent.

Tokens are ordered frame-major, then row, then column, as a Conv3d patch embedding followed by flatten(2) gives.
A contiguous token range is a union of at most five boxes of the grid (partial row, rows, whole frames, rows,
partial row), so a rank reads and writes its share with a handful of strided copies and never touches the rest.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

Box = tuple[int, int, int, int, int, int]  # frames [f0, f1), rows [r0, r1), cols [c0, c1) of the token grid


def conv_patch_embed(conv: torch.nn.Module, patches: torch.Tensor, dtype: torch.dtype = torch.float32
                     ) -> torch.Tensor:
    """A Conv2d / Conv3d patch embedding (kernel == stride) as a linear over flattened patches, in `dtype` (ComfyUI
    runs Wan's patch_embedding in float32; HunyuanVideo's and Wan's other patch embeddings in the model's dtype)."""
    return F.linear(patches.to(dtype), conv.weight.flatten(1).to(dtype), conv.bias.to(dtype))


def frame_runs(first: int, count: int, per_frame: int) -> list[tuple[int, int, int]]:
    """Tokens first..first+count-1 of a frame-major sequence as (frame, start, stop) runs, start / stop counted from
    `first`: one run per latent frame the range touches."""
    runs, start = [], 0
    while start < count:
        frame = (first + start) // per_frame
        stop = min(count, (frame + 1) * per_frame - first)
        runs.append((frame, start, stop))
        start = stop
    return runs


def pad_to_patch_3d(x: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """Pad [B, C, T, H, W] circularly to multiples of the patch size, as ComfyUI's pad_to_patch_size does."""
    pads = [(size - x.shape[2 + axis] % size) % size for axis, size in enumerate(patch)]
    if not any(pads):
        return x
    return F.pad(x, (0, pads[2], 0, pads[1], 0, pads[0]), mode="circular")


@dataclass(frozen=True)
class VideoGrid:
    """frames x rows x cols patches of size patch = (pt, ph, pw) covering a padded latent."""

    frames: int
    rows: int
    cols: int
    patch: tuple[int, int, int]

    @classmethod
    def of(cls, shape_thw: tuple[int, int, int], patch: tuple[int, int, int]) -> "VideoGrid":
        """The grid of a latent of (T, H, W) latent pixels, padded up to whole patches."""
        frames, rows, cols = (-(-size // p) for size, p in zip(shape_thw, patch))
        return cls(frames, rows, cols, tuple(patch))

    @property
    def per_frame(self) -> int:
        return self.rows * self.cols

    @property
    def count(self) -> int:
        return self.frames * self.per_frame

    def positions(self, first: int, stop: int, device=None) -> torch.Tensor:
        """[stop - first, 3] (frame, row, col) grid positions of tokens first..stop-1 (int64)."""
        index = torch.arange(first, stop, device=device)
        frame, rest = index // self.per_frame, index % self.per_frame
        return torch.stack([frame, rest // self.cols, rest % self.cols], dim=1)

    def boxes(self, first: int, stop: int) -> list[Box]:
        """Tokens [first, stop) as at most five boxes, in token order."""
        boxes = []
        while first < stop:
            frame, rest = divmod(first, self.per_frame)
            row, col = divmod(rest, self.cols)
            left = stop - first
            if rest == 0 and left >= self.per_frame:
                count = left // self.per_frame
                boxes.append((frame, frame + count, 0, self.rows, 0, self.cols))
                first += count * self.per_frame
            elif col == 0 and left >= self.cols:
                count = min(self.rows - row, left // self.cols)
                boxes.append((frame, frame + 1, row, row + count, 0, self.cols))
                first += count * self.cols
            else:
                end = min(self.cols, col + left)
                boxes.append((frame, frame + 1, row, row + 1, col, end))
                first += end - col
        return boxes

    def patches(self, padded: torch.Tensor, first: int, stop: int) -> torch.Tensor:
        """Tokens [first, stop) of a padded latent [B, C, T, H, W] as [B, n, C*pt*ph*pw], features (c, pt, ph, pw)
        (the order of a Conv3d weight flattened over its input dims)."""
        pt, ph, pw = self.patch
        batch, channels = padded.shape[:2]
        parts = []
        for f0, f1, r0, r1, c0, c1 in self.boxes(first, stop):
            block = padded[:, :, f0 * pt:f1 * pt, r0 * ph:r1 * ph, c0 * pw:c1 * pw]
            block = block.reshape(batch, channels, f1 - f0, pt, r1 - r0, ph, c1 - c0, pw)
            block = block.permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(batch, -1, channels * pt * ph * pw)
            parts.append(block)
        if not parts:
            return padded.new_empty(batch, 0, channels * pt * ph * pw)
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def write(self, out: torch.Tensor, tokens: torch.Tensor, first: int) -> None:
        """Unpatchify tokens [B, n, pt*ph*pw*C] (features (pt, ph, pw, c), Wan's output order) of grid positions
        first..first+n-1 into out [B, C, T, H, W]; whatever lies beyond out's T, H or W (padding, frames
        appended to the input) is cropped away."""
        pt, ph, pw = self.patch
        batch = tokens.shape[0]
        channels = tokens.shape[2] // (pt * ph * pw)
        limits = out.shape[2:]
        done = 0
        for f0, f1, r0, r1, c0, c1 in self.boxes(first, first + tokens.shape[1]):
            count = (f1 - f0) * (r1 - r0) * (c1 - c0)
            block = tokens[:, done:done + count]
            done += count
            starts = (f0 * pt, r0 * ph, c0 * pw)
            stops = [min(stop * p, limit) for stop, p, limit in zip((f1, r1, c1), self.patch, limits)]
            if any(stop <= start for start, stop in zip(starts, stops)):
                continue
            block = block.reshape(batch, f1 - f0, r1 - r0, c1 - c0, pt, ph, pw, channels)
            block = block.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(
                batch, channels, (f1 - f0) * pt, (r1 - r0) * ph, (c1 - c0) * pw)
            sizes = [stop - start for start, stop in zip(starts, stops)]
            out[:, :, starts[0]:stops[0], starts[1]:stops[1], starts[2]:stops[2]].copy_(
                block[:, :, :sizes[0], :sizes[1], :sizes[2]])
