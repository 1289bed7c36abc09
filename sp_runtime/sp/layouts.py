"""Stream layouts the families share: image latents as patch-token parts at ComfyUI's position ids, a video latent as
one part on its (frame, row, column) grid, and the replicated text stream."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .plan import Embed, Output, Part, Stream
from .tokens import TokenGrid, grid_ids, pad_to_patch, patchify
from .video_tokens import VideoGrid, pad_to_patch_3d


def image_parts(latents: Sequence[torch.Tensor], placements: Sequence[tuple[int, int, int]], patch: int,
                centred: bool, id_dtype: torch.dtype, axes: int, embed: Embed, outputs: int = 1,
                rope_options: Optional[dict] = None) -> list[Part]:
    """One part per latent [B or 1, C, H, W] (patch tokens, features (c, ph, pw)) at its (index, row offset, col
    offset) placement (ScaleROPE's rope_options applied); the first `outputs` latents are the output's frames.
    Rotary axes past the first three (Flux.2's fourth, the text position) are 0 for images. Every rank patchifies
    the (small) latents whole."""
    parts = []
    for number, (latent, (index, row_offset, col_offset)) in enumerate(zip(latents, placements)):
        grid = TokenGrid.of(latent.shape[-2], latent.shape[-1], patch)
        ids = grid_ids(grid, index, row_offset, col_offset, centred, id_dtype, latent.device, rope_options)
        ids = F.pad(ids, (0, axes - 3))
        output = Output(grid, number) if number < outputs else None
        parts.append(Part(patchify(pad_to_patch(latent, patch), patch), ids, embed, output))
    return parts


def video_part(latent: torch.Tensor, patch: tuple[int, int, int], embed: Embed, output: bool = True) -> Part:
    """A latent [B or 1, C, T, H, W] (padded circularly to whole patches) as one part: its patch tokens (features
    (c, pt, ph, pw)), their (frame, row, column) grid positions as float ids, written back over the whole 5-D output
    when `output` (the output tokens then in VideoGrid.write's order (pt, ph, pw, c))."""
    grid = VideoGrid.of(tuple(latent.shape[2:]), patch)
    tokens = grid.patches(pad_to_patch_3d(latent, patch), 0, grid.count)
    ids = grid.positions(0, grid.count, latent.device).float()
    return Part(tokens, ids, embed, Output(grid, None) if output else None)


def text_stream(tokens: torch.Tensor, ids: Optional[torch.Tensor], embed: Embed,
                key_mask: Optional[torch.Tensor] = None) -> Stream:
    """The replicated text stream: every rank holds (and embeds) all text tokens."""
    return Stream("text", [Part(tokens, ids, embed)], split=False, key_mask=key_mask)
