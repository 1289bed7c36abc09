"""Wan 2.1 SCAIL (SCAIL-Preview) and SCAIL-2: a Wan 2.1 I2V 14B with `patch_embedding_pose` (a pose video latent, 20
channels, possibly at half the video's resolution) and, in SCAIL-2, `patch_embedding_mask` (a 28-channel binary
identity mask stream added to the reference / video tokens and to the pose tokens). ComfyUI's inputs:
`reference_latent` [B, 20, R, H, W] (R stacked reference frames, the primary last), `pose_latents` [B, 20, F, H', W'],
`ref_mask_latents` [B, 28, R + T, H, W], `sam_latents` [B, 28, F, H', W'] and `ref_mask_flag` (False: replacement mode).

Under SP the stream is [reference frames, video, pose], the reference and pose parts never output. Rotary, as
ComfyUI's SCAILWanModel places them: the reference frames then the video on one frame axis (replacement mode: the
references 120 rows down, the video from frame R - 1), the pose from frame R (replacement: R - 1), its rows and
columns stretched to the video's extent and 120 columns across. diffusers has no class with these convs, so they are
attached to WanTransformer3DModel here.
"""
from __future__ import annotations

import torch

from ...checkpoints.loading import shape_of
from ...sp import Part, video_part
from ...sp.video_tokens import conv_patch_embed, pad_to_patch_3d
from .plan import patch_embedder, per_item
from .variants import Variant, register

POSE, MASK = "patch_embedding_pose", "patch_embedding_mask"
SHIFT = 120.0  # ComfyUI's rotary offset of the pose columns (and of the reference rows in replacement mode)


def architecture(keys: dict, layout: str, config: dict) -> dict:
    entries = {"pose_in_channels": shape_of(keys, f"{POSE}.weight")[1]}
    if f"{MASK}.weight" in keys:
        entries["mask_in_channels"] = shape_of(keys, f"{MASK}.weight")[1]
    return entries


def attach(model, entries: dict) -> None:
    """Give a WanTransformer3DModel (possibly on the meta device) ComfyUI's pose (and SCAIL-2's mask) Conv3d."""
    patch, width = tuple(model.config.patch_size), model.patch_embedding.out_channels
    device = model.patch_embedding.weight.device
    for name, key in ((POSE, "pose_in_channels"), (MASK, "mask_in_channels")):
        if entries.get(key):
            setattr(model, name, torch.nn.Conv3d(entries[key], width, kernel_size=patch, stride=patch, device=device))


def check(call) -> None:
    x, inputs, has_mask = call.x, call.inputs, hasattr(call.model, MASK)
    if inputs.get("time_dim_concat") is not None:
        raise ValueError("time_dim_concat cannot be combined with a Wan SCAIL model under sequence parallelism")
    if not has_mask:
        for name in ("ref_mask_latents", "sam_latents"):
            if inputs.get(name) is not None:
                raise ValueError(f"{name} needs SCAIL-2's patch_embedding_mask, which this SCAIL model has not")
    reference, pose = inputs.get("reference_latent"), inputs.get("pose_latents")
    frames = x.shape[2] + (0 if reference is None else reference.shape[2])
    _expect("reference_latent", reference, (x.shape[1], None, *x.shape[3:]))
    _expect("pose_latents", pose, (call.model.patch_embedding_pose.in_channels, None, None, None))
    if has_mask:
        _expect("ref_mask_latents", inputs.get("ref_mask_latents"), (call.model.patch_embedding_mask.in_channels,
                                                                     frames, *x.shape[3:]))
        if pose is None and inputs.get("sam_latents") is not None:
            raise ValueError("sam_latents is the pose tokens' mask: it needs pose_latents")
        _expect("sam_latents", inputs.get("sam_latents"), (call.model.patch_embedding_mask.in_channels,
                                                           *([None] * 3 if pose is None else pose.shape[2:])))


def _expect(name: str, tensor, shape) -> None:
    if tensor is None:
        return
    if tensor.dim() != 5 or any(want is not None and got != want for got, want in zip(tensor.shape[1:], shape)):
        wanted = ", ".join("*" if want is None else str(want) for want in shape)
        raise ValueError(f"{name} has shape {list(tensor.shape)}; this Wan SCAIL model takes [B, {wanted}]")


def _with_mask(call, part: Part, mask_name: str, frames) -> None:
    """SCAIL-2's mask stream added to a part's embedding: its patches follow the part's own features."""
    if call.inputs.get(mask_name) is None:
        return
    patch = tuple(call.config.patch_size)
    mask = pad_to_patch_3d(per_item(call.input(mask_name, torch.float32), call.batch), patch)[:, :, frames]
    mask_part = video_part(mask, patch, None, output=False)
    own, width = part.embed, part.tokens.shape[-1]
    part.tokens = torch.cat([part.tokens.expand(mask_part.tokens.shape[0], -1, -1), mask_part.tokens], dim=-1)
    part.embed = lambda model, raw: own(model, raw[..., :width]) + conv_patch_embed(
        getattr(model, MASK), raw[..., width:]).to(call.dtype)


def layout(call, streams) -> None:
    """[reference frames, video, pose] with their positions as ComfyUI's SCAILWanModel.rope_encode places them."""
    patch = tuple(call.config.patch_size)
    video = streams[0].parts[0]
    reference = call.inputs.get("reference_latent")
    frames = 0 if reference is None else reference.shape[2]
    replacement = call.inputs.get("ref_mask_flag") is not None and not bool(call.inputs["ref_mask_flag"])
    start = max(frames - 1, 0) if replacement else frames
    video.ids[:, 0] += start
    _with_mask(call, video, "ref_mask_latents", slice(frames, None))
    if reference is not None:
        latent = pad_to_patch_3d(per_item(call.input("reference_latent", torch.float32), call.batch), patch)
        ahead = video_part(latent, patch, patch_embedder(call), output=False)
        if replacement:
            ahead.ids[:, 1] += SHIFT
        _with_mask(call, ahead, "ref_mask_latents", slice(0, frames))
        streams[0].parts.insert(0, ahead)
    if call.inputs.get("pose_latents") is not None:
        pose = pad_to_patch_3d(per_item(call.input("pose_latents", torch.float32), call.batch), patch)
        part = video_part(pose, patch, patch_embedder(call, POSE), output=False)
        scale = [size / padded for size, padded in zip(call.x.shape[3:], pose.shape[3:])]
        part.ids = part.ids.double()
        part.ids[:, 0] += start
        part.ids[:, 1] = (scale[0] - 1) / 2 + part.ids[:, 1] * scale[0]
        part.ids[:, 2] = SHIFT + (scale[1] - 1) / 2 + part.ids[:, 2] * scale[1]
        _with_mask(call, part, "sam_latents", slice(None))
        streams[0].parts.append(part)


SCAIL = register(Variant(
    "scail", applies=lambda model, variant: variant in ("scail", "scail2"), anchor=(f"{POSE}.", f"{MASK}."),
    architecture=architecture,
    variant=lambda config: ("scail2" if config.get("mask_in_channels") else "scail")
    if config.get("pose_in_channels") else None,
    own_keys=(f"{POSE}.", f"{MASK}."), config_keys=("pose_in_channels", "mask_in_channels"), attach=attach,
    info=lambda model: {"pose_in_channels": getattr(model, POSE).in_channels,
                        "mask_in_channels": getattr(getattr(model, MASK, None), "in_channels", None)},
    comfy={"scail": "WAN21_SCAIL", "scail2": "WAN21_SCAIL2"},
    inputs={name: ("pose_latents", "ref_mask_latents", "sam_latents", "ref_mask_flag") for name in ("scail", "scail2")},
    rope_options=False, check=check, layout=layout, tensor_parallel=True))
