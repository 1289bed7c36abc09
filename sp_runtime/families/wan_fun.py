"""Wan Fun Control's reference image (Fun Control v1.1, Wan 2.2 Fun): `ref_conv`, a Conv2d patch embedding of
ComfyUI's `reference_latent` [B, C, H, W], whose tokens go before the video's as one extra frame.

diffusers has no class with ref_conv, so it is attached to WanTransformer3DModel here. Under SP the reference
tokens are simply frame 0 of a grid one frame longer than the video (ComfyUI's rotary positions: the reference at
frame 0, the video from frame 1): every rank embeds its share of that grid and writes only video tokens back.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..sp.video_tokens import VideoGrid, conv_patch_embed, pad_to_patch_3d


def attach_reference_conv(model, in_channels: int) -> None:
    """Give a WanTransformer3DModel (possibly on the meta device) ComfyUI's ref_conv: patch-sized Conv2d."""
    patch = tuple(model.config.patch_size)[1:]
    device = model.patch_embedding.weight.device
    model.ref_conv = torch.nn.Conv2d(in_channels, model.patch_embedding.out_channels, kernel_size=patch,
                                     stride=patch, device=device)


def reference_frame(model, inputs: dict, x: torch.Tensor, ctx) -> Optional[torch.Tensor]:
    """ComfyUI's reference_latent as a padded one-frame latent [B, C, 1, H', W'], or None (no reference, or a model
    without ref_conv, which ComfyUI ignores it for)."""
    reference = inputs.get("reference_latent")
    if reference is None or getattr(model, "ref_conv", None) is None:
        return None
    channels = model.ref_conv.in_channels
    if reference.dim() != 4 or reference.shape[1] != channels or reference.shape[2:] != x.shape[3:]:
        raise ValueError(f"reference_latent has shape {list(reference.shape)}; this Wan Fun model takes "
                         f"[B, {channels}, {x.shape[3]}, {x.shape[4]}] (one latent frame of x's height and width)")
    reference = ctx.to_device("reference_latent", reference, torch.float32)
    return pad_to_patch_3d(reference.unsqueeze(2), tuple(model.config.patch_size))


def embed_tokens(model, grid: VideoGrid, latent: torch.Tensor, reference: Optional[torch.Tensor], lo: int, hi: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """Tokens [lo, hi) of the sequence (reference frame tokens first when there is one), embedded: [b, n, dim]."""
    lead = 0 if reference is None else grid.per_frame
    parts = []
    if lo < lead:
        frame = VideoGrid(1, grid.rows, grid.cols, (1, *grid.patch[1:]))
        parts.append(conv_patch_embed(model.ref_conv, frame.patches(reference, lo, min(hi, lead)), dtype))
    if hi > lead or not parts:
        video = grid.patches(latent, max(lo, lead) - lead, max(hi, lead) - lead)
        parts.append(conv_patch_embed(model.patch_embedding, video).to(dtype))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


class ReferenceFirstEmbedding(torch.nn.Module):
    """For the single-device reference: stands in for patch_embedding on a latent one frame longer than the video,
    giving ref_conv(reference) as frame 0 and patch_embedding of the video after it."""

    def __init__(self, model, reference: torch.Tensor):
        super().__init__()
        self.patch_embedding, self.ref_conv, self.reference = model.patch_embedding, model.ref_conv, reference

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        video = self.patch_embedding(latent[:, :, 1:])
        return torch.cat([self.ref_conv(self.reference.to(video.dtype)).unsqueeze(2), video], dim=2)
