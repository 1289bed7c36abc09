"""Wan Animate 2 under Ulysses SP: Wan 2.1 I2V 14B's weights (so diffusers' WanTransformer3DModel) driven by a pose
video through a second branch, as ComfyUI's WanAnimate2Model (`comfy/ldm/wan/model_animate2.py`) runs it.

ComfyUI's call adds `pose_latents` [B, 16, T - 1, H, W] (the driving video's latents; x's frame 0 is the reference
image's slot), `context_pose` / `clip_fea_pose` (the pose branch's text and CLIP context, else the main ones),
`pose_strength` and `reference_strength`. The pose branch embeds [pose, ones(4), pose] with the same
patch_embedding, runs every block at timestep 1 on its own tokens (rotary positions from frame 1, columns shifted
past the video's), and hands each block's keys / values to the same block of the video: video frame j attends to
every video token plus pose frame j - 1 (frame 0 to the video tokens only); reference_strength scales frame 0's
values, pose_strength the pose values.

Under SP both branches are streams split in balanced shards ("video": T x hw tokens, "pose": (T - 1) x hw), each
at its own rotary; the block override runs the pose block first under the pose stream's geometry, which keeps its
rotated keys and values (values x pose_strength), then the video block, whose attention passes them to
sp_attention as extra keys (attention.KeyValues) under PoseFrames, the mask "video frame j sees every video token
and pose frame j - 1": sp_attention applies it exactly under Ulysses, Ring and the hybrid.

File names: ComfyUI's repackaged files carry Wan 2.1 I2V's keys and say `model_type: animate2` in their metadata
(ComfyUI reads nothing else: without it the file is Wan 2.1 I2V to ComfyUI too); the Wan-Video release wraps each
block as `blocks.N.block.*`, and diffusers' WanAnimate2Transformer3DModel names the attention layers `to_q` ...:
those two layouts say Animate 2 by their keys alone. animate2_original_key maps both to ComfyUI's names, as
diffusers' convert_wan_animate_2_transformer_to_diffusers maps the release's to diffusers'.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from ...attention import KeyValues, sp_attention
from ...sp import Stream, video_part
from ...sp.processor import Geometry, current_geometry
from ...sp.tokens import rotate
from ...sp.video_tokens import pad_to_patch_3d
from .plan import cross_context, patch_embedder, time_embeddings
from .variants import Variant, register

MODEL_TYPE = "animate2"  # ComfyUI's metadata: {"config": {"transformer": {"model_type": "animate2"}}}
POSE_TIMESTEP = 1.0      # the pose branch's timestep (ComfyUI: ones; diffusers' extract pass: timestep * 0 + 1)
POSE_MASK_CHANNELS = 4   # the pose branch's input: [pose latents, ones(4), pose latents]
RELEASE_BLOCK = re.compile(r"(blocks\.\d+)\.block\.")
_DIFFUSERS_ATTENTION = {".to_q.": ".q.", ".to_k.": ".k.", ".to_v.": ".v.", ".to_out.0.": ".o.",
                        ".add_k_proj.": ".k_img.", ".add_v_proj.": ".v_img.", ".norm_added_k.": ".norm_k_img."}
RELEASE_ANCHOR = "blocks.0.block.self_attn.q.weight"      # the Wan-Video release's layout
DIFFUSERS_ANCHOR = "blocks.0.self_attn.to_q.weight"       # diffusers' WanAnimate2Transformer3DModel's


def animate2_original_key(key: str) -> str:
    """A key of the release or diffusers' Animate 2 layout under ComfyUI's name (other keys unchanged)."""
    key = RELEASE_BLOCK.sub(r"\1.", key, count=1)
    if ".self_attn." in key or ".cross_attn." in key:
        for theirs, ours in _DIFFUSERS_ATTENTION.items():
            if theirs in key:
                return key.replace(theirs, ours, 1)
    return key


def marked(config: dict, path: str) -> dict:
    """Animate 2 is an image-to-video Wan (CLIP image context, noise + mask 4 + image latent channels)."""
    if not config.get("image_dim") or config["in_channels"] != 2 * config["out_channels"] + POSE_MASK_CHANNELS:
        raise ValueError(f"{path!r} says it is a Wan Animate 2 checkpoint but has {config['in_channels']} input "
                         f"channels{'' if config.get('image_dim') else ' and no CLIP image embedder'}; Wan Animate 2 "
                         f"is shaped as Wan 2.1 I2V ({2 * config['out_channels'] + POSE_MASK_CHANNELS} channels, "
                         f"img_emb)")
    return {"animate2": True}


# ---------------------------------------------------------------------------------------------------------------
# Attention: each branch's geometry, and the mask of the video's queries over video and pose keys

@dataclass
class PoseFrames:
    """Video query in frame j (of per_frame tokens) sees every video key (positions < total) and the pose keys of
    pose frame j - 1 (extra keys, positions total + ...); frame 0 sees the video keys only."""

    total: int
    per_frame: int
    with_extra = True  # attend() takes the extra keys too (one SDPA per frame instead of a dense mask)

    def block(self, rows, cols, device):
        query = torch.arange(*rows, device=device)[:, None]
        key = torch.arange(*cols, device=device)[None, :]
        keep = (key < self.total) | ((key - self.total) // self.per_frame == query // self.per_frame - 1)
        return None if bool(keep.all()) else keep[None, None]

    def attend(self, query, key, value, scale):
        total, per_frame, outs = query.shape[2], self.per_frame, []
        for first in range(0, total, per_frame):
            frame = first // per_frame
            keys, values = key[:, :, :total], value[:, :, :total]
            if frame and key.shape[2] > total:
                pose = slice(total + (frame - 1) * per_frame, total + frame * per_frame)
                keys, values = torch.cat([keys, key[:, :, pose]], dim=2), torch.cat([values, value[:, :, pose]], dim=2)
            outs.append(F.scaled_dot_product_attention(query[:, :, first:first + per_frame], keys, values,
                                                       scale=scale))
        return torch.cat(outs, dim=2)


@dataclass
class PoseGeometry(Geometry):
    """The pose branch: plain self-attention over the pose tokens; keeps its rotated keys and values (times
    pose_strength), as exchanged for it where Ulysses exchanged them, for the video attention of the same block."""

    strength: float = 1.0
    keys: Optional[KeyValues] = None

    def attend(self, qkv, text_qkv=None, text_first: bool = True):
        query, key, value = qkv
        query, key = rotate(query, self.rope), rotate(key, self.rope)
        keys = KeyValues(key, value, self.shards)
        out = sp_attention(query, key, value, self.seq, self.shards, keep=keys)
        self.keys = keys if self.strength == 1.0 else keys.values_times(self.strength)
        return out


@dataclass
class VideoGeometry(Geometry):
    """The video branch: values of frame 0 (the reference image) times reference_strength; the pose branch's keys
    and values as extra keys under PoseFrames (without pose: plain self-attention)."""

    lo: int = 0
    per_frame: int = 1
    reference_strength: float = 1.0
    pose: Optional[PoseGeometry] = None

    def attend(self, qkv, text_qkv=None, text_first: bool = True):
        query, key, value = qkv
        query, key = rotate(query, self.rope), rotate(key, self.rope)
        if self.reference_strength != 1.0:
            first = min(max(self.per_frame - self.lo, 0), value.shape[1])
            value = torch.cat([value[:, :first] * self.reference_strength, value[:, first:]], dim=1)
        if self.pose is None:
            return sp_attention(query, key, value, self.seq, self.shards)
        return sp_attention(query, key, value, self.seq, self.shards, mask=PoseFrames(self.shards.total,
                                                                                       self.per_frame),
                            extra=self.pose.keys)


# ---------------------------------------------------------------------------------------------------------------
# The call: the pose stream, both branches' geometries and conditioning, the pose block before each video block

def layout(call, streams) -> None:
    """The pose stream: [pose, ones(4), pose] patch-embedded like x, at ComfyUI's rope_encode_pose positions (frames
    from 1, columns shifted by the grid's width)."""
    if call.inputs.get("pose_latents") is None:
        return
    pose = pad_to_patch_3d(call.input("pose_latents", torch.float32), tuple(call.config.patch_size))
    part = video_part(torch.cat([pose, torch.ones_like(pose[:, :POSE_MASK_CHANNELS]), pose], dim=1),
                      tuple(call.config.patch_size), patch_embedder(call), output=False)
    grid = streams[0].parts[0].output.grid
    part.ids[:, 0] += 1
    part.ids[:, 2] += grid.cols
    streams.append(Stream("pose", [part]))


def prepare(call) -> None:
    """Both branches' geometries; the pose branch's context (its own prompt and CLIP features where given) and its
    modulation at the pose timestep."""
    video = call.shards["video"]
    pose = call.shards.get("pose")
    pose_geometry = None
    if pose is not None:
        pose_geometry = PoseGeometry(call.seq, pose.shards, pose.rope,
                                     strength=strength(call.inputs, "pose_strength"))
        names = [name if call.inputs.get(name) is not None else main
                 for name, main in (("context_pose", "context"), ("clip_fea_pose", "clip_fea"))]
        call.pose_context = cross_context(call, *names)
        sigma = torch.full((call.batch,), POSE_TIMESTEP, device=call.device)
        call.pose_modulation = time_embeddings(call.model, sigma, call.dtype)[1][:, 0]
    call.pose_geometry = pose_geometry
    call.video_geometry = VideoGeometry(call.seq, video.shards, video.rope, lo=video.lo,
                                        per_frame=video.stream.parts[0].output.grid.per_frame,
                                        reference_strength=strength(call.inputs, "reference_strength"),
                                        pose=pose_geometry)


def animate2_block(block, call) -> torch.Tensor:
    """The pose block first (its keys / values feed the video's attention), then the video block."""
    if call.pose_geometry is not None:
        with current_geometry(call.pose_geometry):
            call.pose = block(call.pose, call.pose_context, call.pose_modulation, None)
    with current_geometry(call.video_geometry):
        return block(call.video, call.context, call.block_modulation, None)


def strength(inputs: dict, name: str) -> float:
    """pose_strength or reference_strength as ComfyUI passes them (absent = 1)."""
    value = inputs.get(name)
    return 1.0 if value is None else float(value)


def check(call) -> None:
    config, x, inputs = call.config, call.x, call.inputs
    pose = inputs.get("pose_latents")
    expected = [config.out_channels, x.shape[2] - 1, *x.shape[3:]]
    if pose is not None and (pose.dim() != 5 or list(pose.shape[1:]) != expected):
        raise ValueError(f"pose_latents has shape {list(pose.shape)}; this Wan Animate 2 model takes [B, "
                         f"{', '.join(map(str, expected))}] (one pose frame for each frame of x after the reference "
                         f"image's frame 0)")
    for name in ("context_pose", "clip_fea_pose"):
        extra = inputs.get(name)
        if extra is not None and (extra.dim() != 3 or extra.shape[0] not in (1, x.shape[0])):
            raise ValueError(f"{name} has shape {list(extra.shape)}; it takes [B, tokens, features] as "
                             f"{name.removesuffix('_pose')} does")


ANIMATE2 = register(Variant(
    "animate2", applies=lambda model, variant: variant == "animate2", variant=lambda config: "animate2" if
    config.get("animate2") else None, rename=animate2_original_key, layouts=(RELEASE_ANCHOR, DIFFUSERS_ANCHOR),
    model_type=MODEL_TYPE, marked=marked, original_class="WanAnimate2Transformer3DModel", config_keys=("animate2",),
    comfy={"animate2": "WAN_Animate2"}, inputs={"animate2": ("pose_latents", "context_pose", "clip_fea_pose")},
    rope_options=False, check=check, layout=layout, prepare=prepare, block=animate2_block, tensor_parallel=True))
