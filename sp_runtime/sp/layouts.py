"""Stream layouts the image families share: latents as patch-token parts at ComfyUI's position ids, and the
replicated text stream."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .plan import Embed, Output, Part, Stream
from .tokens import TokenGrid, grid_ids, pad_to_patch, patchify


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


def text_stream(tokens: torch.Tensor, ids: Optional[torch.Tensor], embed: Embed,
                key_mask: Optional[torch.Tensor] = None) -> Stream:
    """The replicated text stream: every rank holds (and embeds) all text tokens."""
    return Stream("text", [Part(tokens, ids, embed)], split=False, key_mask=key_mask)
