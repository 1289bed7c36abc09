"""Wan Fun Camera (Wan 2.1 / 2.2): `control_adapter`, which turns ComfyUI's `camera_conditions` [B, C, T, 8H, 8W]
(Plücker rays per latent frame, at pixel resolution) into one embedding per video token, added to the patches.

diffusers has no camera adapter, so it is stated here with ComfyUI's module names (WanCamAdapter: pixel unshuffle 8,
a patch-sized Conv2d, residual 3x3 blocks), which makes the checkpoint keys load as they are. Each frame goes through
it on its own, but the 3x3 convolutions mix neighbouring tokens, so under SP every rank runs the adapter on the
whole frames its tokens touch and keeps its own tokens.
"""
from __future__ import annotations

import torch
from torch import nn

UNSHUFFLE = 8  # the camera conditions are at pixel resolution: 8 x the latent


class CameraResidualBlock(nn.Module):
    def __init__(self, dim: int, device=None):
        super().__init__()
        self.conv1 = nn.Conv2d(dim, dim, kernel_size=3, padding=1, device=device)
        self.conv2 = nn.Conv2d(dim, dim, kernel_size=3, padding=1, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(torch.relu(self.conv1(x)))


class CameraAdapter(nn.Module):
    """[B, C, T, 8H, 8W] camera conditions -> [B, dim, T, H / ph, W / pw] token embeddings."""

    def __init__(self, in_channels: int, dim: int, patch: tuple[int, int], residual_blocks: int, device=None):
        super().__init__()
        self.in_channels = in_channels
        self.pixel_unshuffle = nn.PixelUnshuffle(UNSHUFFLE)
        self.conv = nn.Conv2d(in_channels * UNSHUFFLE ** 2, dim, kernel_size=patch, stride=patch, device=device)
        self.residual_blocks = nn.Sequential(*[CameraResidualBlock(dim, device) for _ in range(residual_blocks)])

    def forward(self, conditions: torch.Tensor) -> torch.Tensor:
        batch, _, frames = conditions.shape[:3]
        per_frame = conditions.transpose(1, 2).flatten(0, 1)
        out = self.residual_blocks(self.conv(self.pixel_unshuffle(per_frame)))
        return out.unflatten(0, (batch, frames)).transpose(1, 2)


def attach_camera_adapter(model, in_channels: int, residual_blocks: int) -> None:
    """Give a WanTransformer3DModel (possibly on the meta device) ComfyUI's control_adapter."""
    model.control_adapter = CameraAdapter(in_channels, model.patch_embedding.out_channels,
                                          tuple(model.config.patch_size)[1:], residual_blocks,
                                          model.patch_embedding.weight.device)


def camera_tokens(model, inputs: dict, x: torch.Tensor, grid, lo: int, hi: int, ctx, dtype: torch.dtype
                  ) -> torch.Tensor | None:
    """The adapter's embeddings of tokens [lo, hi) of the video grid ([b, n, dim]), or None without
    camera_conditions (ComfyUI then adds nothing) or without tokens on this rank."""
    conditions = inputs.get("camera_conditions")
    if conditions is None:
        return None
    check_camera_conditions(model, conditions, x, inputs)
    if hi == lo:  # (PixelUnshuffle leaves an empty batch as it is, so the adapter cannot run on no frames)
        return None
    first, last = lo // grid.per_frame, -(-hi // grid.per_frame)
    frames = ctx.to_device("camera_conditions", conditions, dtype)[:, :, first:last]
    tokens = model.control_adapter(frames).flatten(2).transpose(1, 2)
    return tokens[:, lo - first * grid.per_frame:hi - first * grid.per_frame]


def check_camera_conditions(model, conditions: torch.Tensor, x: torch.Tensor, inputs: dict) -> None:
    channels = model.control_adapter.in_channels
    patch = tuple(model.config.patch_size)
    expected = [channels, x.shape[2], x.shape[3] * UNSHUFFLE, x.shape[4] * UNSHUFFLE]
    if conditions.dim() != 5 or list(conditions.shape[1:]) != expected:
        raise ValueError(f"camera_conditions has shape {list(conditions.shape)}; this Wan Fun Camera model takes "
                         f"[B, {', '.join(map(str, expected))}] (x's frames at 8 x its height and width)")
    if x.shape[3] % patch[1] or x.shape[4] % patch[2] or inputs.get("time_dim_concat") is not None:
        raise ValueError(f"with camera_conditions, x's height and width must be multiples of {patch[1:]} and "
                         f"time_dim_concat is not taken (as ComfyUI's CameraWanModel)")


class CameraAddedEmbedding(nn.Module):
    """For the single-device reference: patch_embedding with the adapter's output added, as CameraWanModel does."""

    def __init__(self, model, conditions: torch.Tensor):
        super().__init__()
        self.patch_embedding, self.control_adapter, self.conditions = model.patch_embedding, model.control_adapter, \
            conditions

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        return self.patch_embedding(latent) + self.control_adapter(self.conditions.to(latent.dtype))
