"""Wan 2.2 Animate in diffusers' WanAnimateTransformer3DModel: ComfyUI's `pose_latents` [B, 16, T - 1, H, W] (pose
video latents, added per token to frames 1.. of x; frame 0 is the reference image's latent) and `face_pixel_values`
[B, 3, F, 512, 512] (face video, through the motion and face encoders to 5 motion tokens per latent frame, attended
by the face adapter after main blocks 0, 5, 10, ...).

Under SP the pose tokens lie on the video's own token grid, so every rank patch-embeds only the pose patches of its
tokens. The motion tokens are few (5 per frame) and each video token attends only to its own frame's, so every rank
holds them all and attends its tokens frame by frame: exact without exchanging tokens. The motion encoder (a
StyleGAN-style conv net, ~25 GFLOP per 512 x 512 face frame) is the one heavy part that is not per token, so the
ranks share the face frames out, encode their share and all-gather the 512-wide motion vectors; the face encoder
after it (three small temporal convs) runs on every rank.

Original (ComfyUI) key names of the Animate modules map to diffusers' here (animate_key_targets), as diffusers'
convert_wan_transformer_to_diffusers does for a whole state dict: linear1_kv splits into to_k / to_v, the motion
encoder's activation biases [1, C, 1, 1] become [C], and the fixed blur kernels (buffers diffusers rebuilds) are read
past.
"""
from __future__ import annotations

import re
from typing import Optional

import torch

from ...attention import gather_rows, local_attention
from ...groups import SeqParallel
from ...sp.video_tokens import VideoGrid, conv_patch_embed, frame_runs, pad_to_patch_3d
from ...checkpoints.loading import shape_of
from .variants import Variant, register

ANIMATE_MODULES = ("pose_patch_embedding.", "face_adapter.", "face_encoder.", "motion_encoder.")
FACE_EVERY = 5  # ComfyUI and diffusers: a face adapter block after main blocks 0, 5, 10, ...
FACE_SIZE = 512  # the motion encoder's input resolution (its conv stack ends at 1 x 1 only for 512 x 512)

# ----- original (ComfyUI / Wan-Animate) names -> diffusers' WanAnimateTransformer3DModel names -----
_FACE_ADAPTER = {"linear1_q": "to_q", "linear2": "to_out", "q_norm": "norm_q", "k_norm": "norm_k"}
_RESBLOCK = {"conv1.0.weight": "conv1.weight", "conv1.1.bias": "conv1.act_fn.bias", "conv2.1.weight": "conv2.weight",
             "conv2.2.bias": "conv2.act_fn.bias", "skip.1.weight": "conv_skip.weight"}
_BLUR_KERNELS = ("conv2.0.kernel", "skip.0.kernel")  # fixed FIR blur [1, 3, 3, 1], not learned
_CONVS = re.compile(r"motion_encoder\.enc\.net_app\.convs\.(\d+)\.(.+)")


def _first_half(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.narrow(0, 0, tensor.shape[0] // 2)


def _second_half(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.narrow(0, tensor.shape[0] // 2, tensor.shape[0] // 2)


def _channel_bias(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1)


def animate_key_targets(key: str) -> Optional[list]:
    """[(diffusers key, transform)] for an original-layout Animate key ([] for a blur kernel), None if unknown."""
    if key.startswith(("pose_patch_embedding.", "face_encoder.out_proj.")) or key == "face_encoder.padding_tokens":
        return [(key, None)]
    if key.startswith("face_encoder."):
        module, _, kind = key.removeprefix("face_encoder.").rpartition(".")
        conv = module.removesuffix(".conv")
        return [(f"face_encoder.{conv}.{kind}", None)] if conv in ("conv1_local", "conv2", "conv3") else None
    if key.startswith("face_adapter.fuser_blocks."):
        parts = key.removeprefix("face_adapter.fuser_blocks.").split(".")
        if len(parts) != 3:
            return None
        index, module, kind = parts
        stem = f"face_adapter.{index}."
        if module == "linear1_kv":
            return [(f"{stem}to_k.{kind}", _first_half), (f"{stem}to_v.{kind}", _second_half)]
        return [(f"{stem}{_FACE_ADAPTER[module]}.{kind}", None)] if module in _FACE_ADAPTER else None
    if key == "motion_encoder.dec.direction.weight":
        return [("motion_encoder.motion_synthesis_weight", None)]
    if key.startswith("motion_encoder.enc.fc."):
        return [(key.replace("motion_encoder.enc.fc.", "motion_encoder.motion_network."), None)]
    return _motion_conv_targets(key)


def _motion_conv_targets(key: str) -> Optional[list]:
    match = _CONVS.fullmatch(key)
    if match is None:
        return None
    index, rest = int(match.group(1)), match.group(2)
    if index == 0:  # ConvLayer(3, 32, 1): conv, then the activation's bias
        targets = {"0.weight": ("motion_encoder.conv_in.weight", None),
                   "1.bias": ("motion_encoder.conv_in.act_fn.bias", _channel_bias)}
        return [targets[rest]] if rest in targets else None
    if rest == "weight":  # the last conv (4 x 4 to 1 x 1)
        return [("motion_encoder.conv_out.weight", None)]
    if rest in _BLUR_KERNELS:
        return []
    if rest not in _RESBLOCK:
        return None
    return [(f"motion_encoder.res_blocks.{index - 1}.{_RESBLOCK[rest]}",
             _channel_bias if rest.endswith("bias") else None)]


def animate_architecture(keys: dict, layout: str, config: dict) -> dict:
    """WanAnimateTransformer3DModel's Animate settings from the header (keys without prefix)."""
    original, num_layers, in_channels = layout == "original", config["num_layers"], config["in_channels"]
    pose_channels = shape_of(keys, "pose_patch_embedding.weight")[1]
    direction = shape_of(keys, "motion_encoder.dec.direction.weight" if original
                         else "motion_encoder.motion_synthesis_weight")
    conv1 = shape_of(keys, "face_encoder.conv1_local.conv.weight" if original else "face_encoder.conv1_local.weight")
    hidden = shape_of(keys, "face_encoder.conv2.conv.weight" if original else "face_encoder.conv2.weight")[0]
    style = shape_of(keys, "motion_encoder.enc.net_app.convs.8.weight" if original
                     else "motion_encoder.conv_out.weight")[0]
    face_blocks = len({key.split(".")[2 if original else 1] for key in keys if key.startswith("face_adapter.")})
    if in_channels != 2 * pose_channels + 4:
        raise ValueError(f"this Wan Animate checkpoint takes {in_channels} input channels with {pose_channels}-channel "
                         f"pose latents; Wan Animate's input is noise + mask 4 + reference ({2 * pose_channels + 4})")
    if num_layers % FACE_EVERY or face_blocks != num_layers // FACE_EVERY:
        raise ValueError(f"this Wan Animate checkpoint has {face_blocks} face adapter blocks for {num_layers} blocks; "
                         f"Wan Animate has one after every {FACE_EVERY}th block ({num_layers // FACE_EVERY})")
    return {"latent_channels": pose_channels, "motion_encoder_dim": direction[0], "motion_dim": direction[1],
            "motion_style_dim": style, "face_encoder_hidden_dim": hidden, "face_encoder_num_heads": conv1[0] // hidden}


def motion_tokens(model, face: torch.Tensor, seq: SeqParallel) -> torch.Tensor:
    """face video [B, 3, F, 512, 512] -> motion tokens [B, 1 + frames', 5, dim]: the motion encoder per face frame
    (this rank's share, in batches as ComfyUI), all-gathered, the face encoder over time, and a zero frame first (the
    reference image's frame)."""
    batch, _, frames = face.shape[:3]
    images = face.transpose(1, 2).flatten(0, 1)
    share = -(-images.shape[0] // seq.degree)
    mine = images[seq.rank * share:(seq.rank + 1) * share]
    encoded = [model.motion_encoder(chunk) for chunk in mine.split(model.config.motion_encoder_batch_size)]
    width = model.config.motion_encoder_dim
    padding = mine.new_zeros(share - mine.shape[0], width)  # every rank sends `share` rows
    motion = gather_rows(torch.cat([*encoded, padding]), seq)[:images.shape[0]].view(batch, frames, width)
    tokens = model.face_encoder(motion)
    return torch.cat([torch.zeros_like(tokens[:, :1]), tokens], dim=1)


# ---------------------------------------------------------------------------------------------------------------
# The call: pose tokens onto this rank's video tokens, the face adapter after every FACE_EVERY-th block

def check(call) -> None:
    config, x, inputs = call.config, call.x, call.inputs
    pose, face = inputs.get("pose_latents"), inputs.get("face_pixel_values")
    if pose is not None and (pose.dim() != 5 or pose.shape[1] != config.latent_channels
                             or pose.shape[3:] != x.shape[3:]):
        raise ValueError(f"pose_latents has shape {list(pose.shape)}; this Wan Animate model takes [B, "
                         f"{config.latent_channels}, frames, {x.shape[3]}, {x.shape[4]}] (pose frame j goes onto "
                         f"frame j + 1 of x)")
    if face is not None and (face.dim() != 5 or face.shape[1] != 3 or face.shape[3:] != (FACE_SIZE, FACE_SIZE)):
        raise ValueError(f"face_pixel_values has shape {list(face.shape)}; this Wan Animate model takes [B, 3, "
                         f"frames, {FACE_SIZE}, {FACE_SIZE}] (the face video in -1..1, as ComfyUI's WanAnimateToVideo "
                         f"gives it)")


def embed(call) -> None:
    """The pose latents' embeddings added as ComfyUI does: pose frame j onto video frame j + 1, for the frames both
    have."""
    if call.inputs.get("pose_latents") is None:
        return
    shard = call.shards["video"]
    lo, hi, grid = shard.lo, shard.hi, shard.stream.parts[0].output.grid
    pose = pad_to_patch_3d(call.input("pose_latents", torch.float32), tuple(call.config.patch_size))
    pose_grid = VideoGrid(pose.shape[2] // grid.patch[0], grid.rows, grid.cols, grid.patch)
    first = max(lo, grid.per_frame)
    stop = min(hi, (1 + min(pose_grid.frames, grid.frames - 1)) * grid.per_frame)
    if stop <= first:
        return
    patches = pose_grid.patches(pose, first - grid.per_frame, stop - grid.per_frame)
    hidden = call.video.clone()
    hidden[:, first - lo:stop - lo] += conv_patch_embed(call.model.pose_patch_embedding, patches, call.dtype)
    call.video = hidden


def prepare(call) -> None:
    """The motion tokens of every latent frame [b, frames, 5, dim], or None without face_pixel_values (ComfyUI then
    adds no face)."""
    call.face_motion = None
    if call.inputs.get("face_pixel_values") is None:
        return
    frames = call.shards["video"].stream.parts[0].output.grid.frames
    tokens = motion_tokens(call.model, call.input("face_pixel_values"), call.seq)
    if tokens.shape[1] < frames:  # ComfyUI: zero motion for frames beyond the face video's, extra ones dropped
        tokens = torch.cat([tokens, tokens.new_zeros(tokens.shape[0], frames - tokens.shape[1], *tokens.shape[2:])],
                           dim=1)
    call.face_motion = tokens[:, :frames]


def after(call, index: int, block) -> None:
    """The face adapter's output added after main blocks 0, 5, 10, ...: each of this rank's tokens attends to its own
    frame's motion tokens."""
    if call.face_motion is None or index % FACE_EVERY:
        return
    adapter, hidden, shard = call.model.face_adapter[index // FACE_EVERY], call.video, call.shards["video"]
    heads = adapter.heads
    query = adapter.norm_q(adapter.to_q(adapter.pre_norm_q(hidden)).unflatten(2, (heads, -1)))
    motion = adapter.pre_norm_kv(call.face_motion.expand(hidden.shape[0], *call.face_motion.shape[1:]))
    key = adapter.norm_k(adapter.to_k(motion).unflatten(-1, (heads, -1)))
    value = adapter.to_v(motion).unflatten(-1, (heads, -1))
    parts = [local_attention(query[:, start:stop], key[:, frame], value[:, frame]) for frame, start, stop in
             frame_runs(shard.lo, hidden.shape[1], shard.stream.parts[0].output.grid.per_frame)]
    out = torch.cat(parts, dim=1) if parts else query
    call.video = hidden + adapter.to_out(out.flatten(2, 3).type_as(hidden))


ANIMATE = register(Variant(
    "animate", applies=lambda model, variant: getattr(model, "face_adapter", None) is not None,
    anchor=ANIMATE_MODULES, architecture=animate_architecture,
    variant=lambda config: "animate" if config.get("motion_encoder_dim") else None,
    key_targets=animate_key_targets, mapped_keys=ANIMATE_MODULES, model_class="WanAnimateTransformer3DModel",
    comfy={"animate": "WAN22_Animate"}, inputs={"animate": ("face_pixel_values", "pose_latents")},
    rope_options=False, check=check, embed=embed, prepare=prepare, after=after, tensor_parallel=True))
