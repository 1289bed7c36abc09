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

from ...checkpoints.loading import count_blocks, shape_of
from .detect import SUPPORTED
from .variants import Variant, register

UNSHUFFLE = 8  # the camera conditions are at pixel resolution: 8 x the latent
ADAPTER = "control_adapter"  # the same name in both layouts


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


def attach(model, entries: dict) -> None:
    """Give a WanTransformer3DModel (possibly on the meta device) ComfyUI's control_adapter."""
    model.control_adapter = CameraAdapter(entries["camera_in_channels"], model.patch_embedding.out_channels,
                                          tuple(model.config.patch_size)[1:], entries["camera_residual_blocks"],
                                          model.patch_embedding.weight.device)


def architecture(keys: dict, layout: str, config: dict) -> dict:
    return {"camera_in_channels": shape_of(keys, f"{ADAPTER}.conv.weight")[1] // UNSHUFFLE ** 2,
            "camera_residual_blocks": count_blocks(keys, f"{ADAPTER}.residual_blocks")}


def variant_of(config: dict):
    """ComfyUI's model types: camera (with CLIP) and camera_2.2; the 5B Control-Camera has no class there."""
    if not config.get("camera_in_channels"):
        return None
    if config["out_channels"] == 48:
        raise ValueError(f"this is a Wan 2.2 Fun 5B Control-Camera checkpoint (48-channel latents, "
                         f"{config['in_channels']} input channels, the camera adapter): ComfyUI has no model "
                         f"class for it (its camera_2.2 models take 36 channels), so it is not supported; "
                         f"supported: {SUPPORTED}")
    return "camera" if config.get("image_dim") else "camera_2.2"


def check(call) -> None:
    conditions, x = call.inputs.get("camera_conditions"), call.x
    if conditions is None:
        return
    channels, patch = call.model.control_adapter.in_channels, tuple(call.config.patch_size)
    expected = [channels, x.shape[2], x.shape[3] * UNSHUFFLE, x.shape[4] * UNSHUFFLE]
    if conditions.dim() != 5 or list(conditions.shape[1:]) != expected:
        raise ValueError(f"camera_conditions has shape {list(conditions.shape)}; this Wan Fun Camera model takes "
                         f"[B, {', '.join(map(str, expected))}] (x's frames at 8 x its height and width)")
    if x.shape[3] % patch[1] or x.shape[4] % patch[2] or call.inputs.get("time_dim_concat") is not None:
        raise ValueError(f"with camera_conditions, x's height and width must be multiples of {patch[1:]} and "
                         f"time_dim_concat is not taken (as ComfyUI's CameraWanModel)")


def embed(call) -> None:
    """The adapter's embeddings of this rank's tokens added (ComfyUI adds nothing without camera_conditions)."""
    shard = call.shards["video"]
    lo, hi = shard.lo, shard.hi
    if call.inputs.get("camera_conditions") is None or hi == lo:  # (PixelUnshuffle cannot run on no frames)
        return
    per_frame = shard.stream.parts[0].output.grid.per_frame
    first, last = lo // per_frame, -(-hi // per_frame)
    frames = call.input("camera_conditions")[:, :, first:last]
    tokens = call.model.control_adapter(frames).flatten(2).transpose(1, 2)
    call.video = call.video + tokens[:, lo - first * per_frame:hi - first * per_frame]


CAMERA_INPUTS = ("camera_conditions",)
CAMERA = register(Variant(
    "camera", applies=lambda model, variant: getattr(model, ADAPTER, None) is not None,
    anchor=f"{ADAPTER}.conv.weight", architecture=architecture, variant=variant_of, own_keys=(ADAPTER + ".",),
    config_keys=("camera_in_channels", "camera_residual_blocks"), attach=attach,
    info=lambda model: {"camera_in_channels": model.control_adapter.in_channels},
    comfy={"camera": "WAN21_Camera", "camera_2.2": "WAN22_Camera"},
    inputs={"camera": CAMERA_INPUTS, "camera_2.2": CAMERA_INPUTS}, check=check, embed=embed, tensor_parallel=True))
