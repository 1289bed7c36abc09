"""Token layouts shared by the families: ComfyUI's latent packing (circular padding to the patch size, patches as
(c, ph, pw) features), the token grid of a latent and writing tokens back into it, ComfyUI's position ids for image
and reference latents, rotary tables and their application, text key masks, and the single-process reference packing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .rope_options import is_identity, scaled_positions

ROPE_THETA = 10000


# ---------------------------------------------------------------------------------------------------------------
# Architecture facts a header cannot show

def rope_axes(head_dim: int) -> tuple[int, int, int]:
    """Rotary dims of the (index, row, column) axes: (16, 56, 56) at the real head size 128.

    Checkpoints do not store them; other head sizes (tiny test models) follow the same proportions: about an
    eighth for the index axis, the rest split evenly, every part even.
    """
    if head_dim % 2 or head_dim < 6:
        raise ValueError(f"head size {head_dim} cannot carry 3-axis rotary embeddings (needs an even size >= 6)")
    spatial = 2 * ((head_dim - max(2, 2 * round(head_dim / 16))) // 4)
    return head_dim - 2 * spatial, spatial, spatial


# ---------------------------------------------------------------------------------------------------------------
# Latent <-> tokens

def pad_to_patch(x: torch.Tensor, patch: int) -> torch.Tensor:
    """Pad the last two dims to a multiple of the patch size, circularly (what ComfyUI's models do)."""
    pad_h = (patch - x.shape[-2] % patch) % patch
    pad_w = (patch - x.shape[-1] % patch) % patch
    if pad_h == 0 and pad_w == 0:
        return x
    return F.pad(x, (0, pad_w, 0, pad_h), mode="circular")


def patchify(x: torch.Tensor, patch: int) -> torch.Tensor:
    """[B, C, H, W] (padded) -> [B, (H/p)(W/p), C*p*p] tokens, row-major, features ordered (c, ph, pw)."""
    batch, channels, height, width = x.shape
    rows, cols = height // patch, width // patch
    tokens = x.reshape(batch, channels, rows, patch, cols, patch).permute(0, 2, 4, 1, 3, 5)
    return tokens.reshape(batch, rows * cols, channels * patch * patch)


@dataclass(frozen=True)
class TokenGrid:
    """The token grid of one latent: rows x cols patches covering height x width latent pixels (padded)."""

    rows: int
    cols: int
    height: int
    width: int
    patch: int

    @classmethod
    def of(cls, height: int, width: int, patch: int) -> "TokenGrid":
        return cls(-(-height // patch), -(-width // patch), height, width, patch)

    @property
    def count(self) -> int:
        return self.rows * self.cols

    def rectangles(self, first: int, stop: int) -> list[tuple[int, int, int, int]]:
        """Tokens [first, stop) as at most 3 (row0, row1, col0, col1) blocks: partial row, full rows, partial row."""
        blocks = []
        while first < stop:
            row, col = divmod(first, self.cols)
            if col == 0 and stop - first >= self.cols:
                full = (stop - first) // self.cols
                blocks.append((row, row + full, 0, self.cols))
                first += full * self.cols
            else:
                end = min(self.cols, col + stop - first)
                blocks.append((row, row + 1, col, end))
                first += end - col
        return blocks

    def write(self, out: torch.Tensor, tokens: torch.Tensor, first: int) -> None:
        """Unpatchify tokens [B, n, C*p*p] (grid positions first..first+n) into out [B, C, height, width], cropped."""
        p = self.patch
        done = 0
        for row0, row1, col0, col1 in self.rectangles(first, first + tokens.shape[1]):
            rows, cols = row1 - row0, col1 - col0
            block = tokens[:, done:done + rows * cols]
            done += rows * cols
            block = block.reshape(block.shape[0], rows, cols, -1, p, p).permute(0, 3, 1, 4, 2, 5)
            block = block.reshape(block.shape[0], block.shape[1], rows * p, cols * p)
            top, left = row0 * p, col0 * p
            bottom, right = min(row1 * p, self.height), min(col1 * p, self.width)
            if bottom <= top or right <= left:  # tokens past the output (e.g. HiDream E1's reference columns)
                continue
            out[:, :, top:bottom, left:right].copy_(block[:, :, :bottom - top, :right - left])


# ---------------------------------------------------------------------------------------------------------------
# Position ids (ComfyUI's conventions, which the outputs must reproduce)

def grid_ids(grid: TokenGrid, index: float, row_offset: int, col_offset: int, centred: bool,
             dtype: torch.dtype, device: torch.device, rope_options: Optional[dict] = None) -> torch.Tensor:
    """[rows*cols, 3] (index, row, col) ids of one latent's tokens; offsets in latent pixels, as ComfyUI gives;
    ScaleROPE's rope_options scale the rows and columns from their start and shift all three (Flux's process_img).

    ComfyUI builds the row / column ranges in the latent's dtype (exact below 256 in bf16), so do we.
    """
    half = grid.patch // 2
    row_start = (row_offset + half) // grid.patch
    col_start = (col_offset + half) // grid.patch
    rows = torch.arange(row_start, row_start + grid.rows, device=device).to(dtype).float()
    cols = torch.arange(col_start, col_start + grid.cols, device=device).to(dtype).float()
    if centred:  # Qwen-Image centres the grid on 0
        rows, cols = rows - grid.rows // 2, cols - grid.cols // 2
    ids = torch.empty(grid.rows, grid.cols, 3, device=device)
    ids[..., 0] = index
    ids[..., 1] = rows[:, None]
    ids[..., 2] = cols[None, :]
    if is_identity(rope_options):
        return ids.reshape(-1, 3)
    return scaled_positions(ids.reshape(-1, 3), rope_options, starts=(index, row_start, col_start)).float()


def reference_placements(method: str, shape_hw: tuple[int, int], refs_hw: Sequence[tuple[int, int]],
                         patch: int, methods: Sequence[str]) -> list[tuple[int, int, int]]:
    """(index, row offset, col offset) of each reference latent, following ComfyUI's ref_latents_method.

    `methods` are the names the family knows besides "offset"; any other name takes ComfyUI's default branch,
    which places the references side by side ("offset").
    """
    method = method if method in methods else "offset"
    placements, index, used_h, used_w = [], 0, 0, 0
    grid = TokenGrid.of(shape_hw[0], shape_hw[1], patch)
    for ref_h, ref_w in refs_hw:
        if method in ("index", "index_timestep_zero"):
            index += 1
            placements.append((index, 0, 0))
        elif method == "negative_index":
            index -= 1
            placements.append((index, 0, 0))
        elif method == "uxo":
            placements.append((0, grid.rows * patch + used_h, grid.cols * patch + used_w))
            used_h, used_w = used_h + ref_h, used_w + ref_w
        else:
            row_offset = col_offset = 0
            if ref_h + used_h > ref_w + used_w:
                col_offset = used_w
            else:
                row_offset = used_h
            used_h, used_w = max(used_h, ref_h + row_offset), max(used_w, ref_w + col_offset)
            placements.append((1, row_offset, col_offset))
    return placements


# ---------------------------------------------------------------------------------------------------------------
# Rotary and text masks

def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """diffusers' rotary (apply_rotary_emb, interleaved pairs) on [B, S, H, D] with rotary()'s tables, as one
    complex product in float32 (diffusers' real form makes five float32 passes: 4x slower on a CPU, same values); a
    rank with no tokens (more ranks than tokens) has nothing to rotate."""
    if not x.shape[1]:
        return x
    cos, sin = rope
    turn = torch.complex(cos[:, 0::2].float(), sin[:, 0::2].float())[None, :, None, :]
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * turn).flatten(-2).to(x.dtype)


@dataclass(frozen=True, eq=False)  # compared by identity: the executor's rotary cache compares rope specs
class PairFrequencies:
    """A rotary whose every channel pair has its own frequency and position axis, angles in float32 as the models
    that use it compute them (Qwen-VL's interleaved MRoPE: Ideogram 4). Pairs are adjacent channels here, as the
    executor rotates them; a split-half model (pairs i, i + D/2) reorders its q / k channels by split_half_order.

    inv_freq: float32 [D/2]; axis: long [D/2], the ids column each pair rotates by."""

    inv_freq: torch.Tensor
    axis: torch.Tensor

    @classmethod
    def interleaved_mrope(cls, head_dim: int, theta: float, sections: Sequence[int]) -> "PairFrequencies":
        """Qwen-VL's interleaved MRoPE: theta^(-2i/D) on every pair, axis 0 (t) except pairs 1, 4, ... below
        3 x sections[1] (h) and 2, 5, ... below 3 x sections[2] (w)."""
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
        axis = torch.zeros(head_dim // 2, dtype=torch.long)
        for which in (1, 2):
            axis[which:3 * sections[which]:3] = which
        return cls(inv_freq, axis)

    def tables(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = ids[:, self.axis.to(ids.device)].float() * self.inv_freq.to(ids.device)
        return angles.cos().repeat_interleave(2, dim=-1), angles.sin().repeat_interleave(2, dim=-1)


def split_half_order(head_dim: int, rotary: int) -> torch.Tensor:
    """Channel order putting split-half rotary pairs (i, i + rotary/2) next to each other, the rest after."""
    half = rotary // 2
    pairs = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()
    return torch.cat([pairs, torch.arange(rotary, head_dim)])


def rotary(ids: torch.Tensor, axes, theta=ROPE_THETA) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [S, head_dim] for ids [S, len(axes)], interleaved per pair; float64 angles as ComfyUI and
    diffusers. theta: one for every axis, or a sequence of one per axis (Cosmos' NTK-scaled axes). axes may be a
    PairFrequencies instead (theta unused)."""
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed
    if isinstance(axes, PairFrequencies):
        return axes.tables(ids)
    if isinstance(theta, (int, float)):
        return FluxPosEmbed(theta=theta, axes_dim=list(axes))(ids)
    tables = [FluxPosEmbed(theta=each, axes_dim=[size])(ids[:, axis:axis + 1])
              for axis, (size, each) in enumerate(zip(axes, theta))]
    return torch.cat([cos for cos, _ in tables], dim=-1), torch.cat([sin for _, sin in tables], dim=-1)


def text_key_mask(mask: Optional[torch.Tensor], batch: int, length: int) -> Optional[torch.Tensor]:
    """A text padding mask as bool [B, L] (True = attend), or None when nothing is masked.

    Accepts ComfyUI's forms: 1/0 or bool keep-masks, and additive float masks (0 = keep, large negative = drop).
    """
    if mask is None:
        return None
    if mask.dim() != 2 or mask.shape[-1] != length or mask.shape[0] not in (1, batch):
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}; expected [batch, text tokens] = "
                         f"[{batch}, {length}]")
    if mask.dtype == torch.bool:
        keep = mask
    elif mask.is_floating_point() and bool((mask < 0).any()):
        if bool(((mask < 0) & (mask > -1e4)).any()) or bool((mask > 0).any()):
            raise ValueError("attention_mask holds additive values other than 0 and a large negative number: only "
                             "keep / drop text masks are supported")
        keep = mask == 0
    else:
        keep = mask != 0
    keep = keep.expand(batch, length)
    return None if bool(keep.all()) else keep


def as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


# ---------------------------------------------------------------------------------------------------------------
# Single-process reference packing (tests, demo, benchmarks): written apart from the SP path on purpose

def reference_pack(latent: torch.Tensor, patch: int) -> tuple[torch.Tensor, TokenGrid]:
    """[B, C, H, W] -> ([B, N, C*p*p] tokens, grid): wrap-around padding by concatenation, then F.unfold."""
    grid = TokenGrid.of(latent.shape[-2], latent.shape[-1], patch)
    extra_rows, extra_cols = grid.rows * patch - grid.height, grid.cols * patch - grid.width
    latent = torch.cat([latent, latent[:, :, :extra_rows]], dim=2) if extra_rows else latent
    latent = torch.cat([latent, latent[:, :, :, :extra_cols]], dim=3) if extra_cols else latent
    tokens = F.unfold(latent.float(), kernel_size=patch, stride=patch).transpose(1, 2)
    return tokens.to(latent.dtype), grid


def reference_unpack(tokens: torch.Tensor, grid: TokenGrid) -> torch.Tensor:
    """[B, N, C*p*p] tokens -> [B, C, H, W] with F.fold, cropped to the unpadded size."""
    size = (grid.rows * grid.patch, grid.cols * grid.patch)
    latent = F.fold(tokens.float().transpose(1, 2), size, kernel_size=grid.patch, stride=grid.patch)
    return latent[:, :, :grid.height, :grid.width].to(tokens.dtype)
