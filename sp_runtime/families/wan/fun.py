"""Wan Fun Control's reference image (Fun Control v1.1, Wan 2.2 Fun): `ref_conv`, a Conv2d patch embedding of
ComfyUI's `reference_latent` [B, C, H, W], whose tokens go before the video's as one extra frame.

diffusers has no class with ref_conv, so it is attached to WanTransformer3DModel here. Under SP the reference is a
part of the video stream ahead of the video (ComfyUI's rotary positions: the reference at frame 0, the video from
frame 1), embedded by ref_conv and never output.
"""
from __future__ import annotations

import torch

from ...checkpoints.loading import shape_of
from ...sp import Part, video_part
from .plan import patch_embedder, per_item
from .variants import Variant, register

FUN_CONTROL_CHANNELS = 48  # noise 16 + control video 16 + image latent 16 (ComfyUI's WAN21_FunControl2V)


def attach(model, entries: dict) -> None:
    """Give a WanTransformer3DModel (possibly on the meta device) ComfyUI's ref_conv: patch-sized Conv2d."""
    patch = tuple(model.config.patch_size)[1:]
    device = model.patch_embedding.weight.device
    model.ref_conv = torch.nn.Conv2d(entries["ref_in_channels"], model.patch_embedding.out_channels,
                                     kernel_size=patch, stride=patch, device=device)


def layout(call, streams) -> None:
    """The reference frame's part ahead of the video's, the video's positions one frame on."""
    reference = call.inputs.get("reference_latent")
    if reference is None:
        return
    x, channels = call.x, call.model.ref_conv.in_channels
    if reference.dim() != 4 or reference.shape[1] != channels or reference.shape[2:] != x.shape[3:]:
        raise ValueError(f"reference_latent has shape {list(reference.shape)}; this Wan Fun model takes "
                         f"[B, {channels}, {x.shape[3]}, {x.shape[4]}] (one latent frame of x's height and width)")
    video = streams[0].parts[0]
    video.ids[:, 0] += 1
    frame = per_item(call.input("reference_latent", torch.float32), call.batch).unsqueeze(2)
    ahead = video_part(frame, (1, *call.config.patch_size[1:]), patch_embedder(call, "ref_conv"), output=False)
    streams[0].parts.insert(0, Part(ahead.tokens, ahead.ids, ahead.embed))


FUN = register(Variant(
    "fun", applies=lambda model, variant: getattr(model, "ref_conv", None) is not None, anchor="ref_conv.weight",
    architecture=lambda keys, layout, config: {"ref_in_channels": shape_of(keys, "ref_conv.weight")[1]},
    variant=lambda config: "fun_control" if config.get("image_dim") and config["in_channels"] ==
    FUN_CONTROL_CHANNELS else None,
    own_keys=("ref_conv.",), config_keys=("ref_in_channels",), attach=attach,
    info=lambda model: {"ref_in_channels": model.ref_conv.in_channels},
    comfy={"fun_control": "WAN21_FunControl2V"}, layout=layout, tensor_parallel=True))
