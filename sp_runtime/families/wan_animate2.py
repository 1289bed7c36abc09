"""Wan Animate 2 under Ulysses SP: Wan 2.1 I2V 14B's weights (so diffusers' WanTransformer3DModel) driven by a pose
video through a second branch, as ComfyUI's WanAnimate2Model (`comfy/ldm/wan/model_animate2.py`) runs it.

ComfyUI's call adds `pose_latents` [B, 16, T - 1, H, W] (the driving video's latents; x's frame 0 is the reference
image's slot), `context_pose` / `clip_fea_pose` (the pose branch's text and CLIP context, else the main ones),
`pose_strength` and `reference_strength`. The pose branch embeds [pose, ones(4), pose] with the same
patch_embedding, runs every block at timestep 1 on its own tokens (rotary positions from frame 1, columns shifted
past the video's), and hands each block's keys / values to the same block of the video: video frame j attends to
every video token plus pose frame j - 1 (frame 0 to the video tokens only); reference_strength scales frame 0's
values, pose_strength the pose values.

SP plan. Both branches' tokens are split over the sequence group (balanced shards of T x hw and (T - 1) x hw
tokens). The pose tokens of frame j - 1 line up with the video's frame j, but a video query needs all hw pose
tokens of its frame, not only those at its own positions, so a shared split would still need the neighbours' parts
of every frame a shard boundary cuts. Instead the pose branch's own self-attention (a plain Ulysses exchange: every
rank gets all pose tokens for its heads) already leaves each rank holding exactly the pose keys / values the video
attention of the same block needs for those heads; they are kept for it, so the pose branch costs one exchange
pair per block like the video's and nothing more. Under Ring (and batch-1 calls under CFG-parallel, which run as
more ring blocks) the keys / values of each branch are all-gathered over the ring group after the Ulysses exchange,
each rank attending its ring block's queries: exact, with the memory of Ulysses over all ranks.

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

from ..attention.backends import attend
from ..attention.ring import gather_shards
from ..attention.shards import SeqShards
from ..attention.ulysses import exchange_to_heads, exchange_to_tokens, gather_sequence
from ..groups import SeqParallel
from ..sp.video_tokens import VideoGrid, conv_patch_embed, frame_runs, pad_to_patch_3d
from .wan_common import rotate

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


def check_animate2_architecture(config: dict, path: str) -> None:
    """Animate 2 is an image-to-video Wan (CLIP image context, noise + mask 4 + image latent channels)."""
    if not config.get("image_dim") or config["in_channels"] != 2 * config["out_channels"] + POSE_MASK_CHANNELS:
        raise ValueError(f"{path!r} says it is a Wan Animate 2 checkpoint but has {config['in_channels']} input "
                         f"channels{'' if config.get('image_dim') else ' and no CLIP image embedder'}; Wan Animate 2 "
                         f"is shaped as Wan 2.1 I2V ({2 * config['out_channels'] + POSE_MASK_CHANNELS} channels, "
                         f"img_emb)")


# ---------------------------------------------------------------------------------------------------------------
# Attention: the processor of both branches' self-attention, and each branch's plan (its `rotary_emb`)

class Animate2SelfAttention:
    """WanAttnProcessor's self-attention on this rank's tokens; the plan (PoseAttention or VideoAttention) says
    which keys each query attends to."""

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None) -> torch.Tensor:
        plan = rotary_emb
        if not isinstance(plan, (PoseAttention, VideoAttention)):
            raise TypeError("Animate2SelfAttention runs inside the sequence-parallel Wan Animate 2 forward only")
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        query, key = rotate(query, plan.cos, plan.sin), rotate(key, plan.cos, plan.sin)
        out = plan.attend(query, key, value).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


@dataclass
class _Split:
    """One branch's tokens over the sequence group, and this rank's rotary factors [1, n, 1, D/2]."""

    seq: SeqParallel
    shards: SeqShards
    cos: torch.Tensor
    sin: torch.Tensor

    def to_heads(self, query, key, value) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """[B, n, H, D] of this rank's tokens -> q [B, h, m, D] of this ring block's tokens and k, v [B, h, S, D] of
        every token, for this rank's heads; and the block's first token."""
        degree, ring_rank = self.seq.ulysses_degree, self.seq.ring_rank
        block = self.shards.block(ring_rank * degree, degree)
        if degree > 1:
            q, k, v = gather_sequence(exchange_to_heads(query, key, value, self.seq.ulysses_group, block),
                                      block.sizes)
        else:
            q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        if self.seq.ring_degree > 1:
            blocks = SeqShards(self.shards.total, tuple(self.shards.block(r * degree, degree).total
                                                        for r in range(self.seq.ring_degree)))
            k, v = gather_shards(torch.cat([k, v]), blocks, self.seq.ring_group).chunk(2)
        return q, k, v, self.shards.offset(ring_rank * degree)

    def to_tokens(self, out: torch.Tensor, local_tokens: int, heads: int) -> torch.Tensor:
        """[B, h, m, D] outputs of this ring block's tokens -> [B, n, H, D] of this rank's tokens."""
        degree = self.seq.ulysses_degree
        if degree == 1:
            return out.transpose(1, 2)
        block = self.shards.block(self.seq.ring_rank * degree, degree)
        return exchange_to_tokens(out, None, self.seq.ulysses_group, block, local_tokens, heads)[0]


@dataclass
class PoseAttention(_Split):
    """The pose branch: plain self-attention over the pose tokens; keeps the keys / values (every pose token, this
    rank's heads, values times pose_strength) for the video attention of the same block."""

    strength: float = 1.0
    key: Optional[torch.Tensor] = None
    value: Optional[torch.Tensor] = None

    @torch.compiler.disable  # compiled blocks leave the exchanges to eager mode
    def attend(self, query, key, value) -> torch.Tensor:
        q, k, v, _ = self.to_heads(query, key, value)
        out = attend(q, k, v)
        self.key, self.value = k, v if self.strength == 1.0 else v * self.strength
        return self.to_tokens(out, query.shape[1], query.shape[2])


@dataclass
class VideoAttention(_Split):
    """The video branch: frame j attends to every video token plus pose frame j - 1 (kept by `pose`); without pose
    (ComfyUI's node windows it out of some steps) plain self-attention."""

    per_frame: int = 1
    pose: Optional[PoseAttention] = None
    reference_strength: float = 1.0

    @torch.compiler.disable
    def attend(self, query, key, value) -> torch.Tensor:
        q, k, v, first = self.to_heads(query, key, value)
        if self.reference_strength != 1.0:  # frame 0 holds the reference image
            v = torch.cat([v[:, :, :self.per_frame] * self.reference_strength, v[:, :, self.per_frame:]], dim=2)
        if self.pose is None:
            out = attend(q, k, v)
        else:
            out = torch.cat([self._frame(q[:, :, start:stop], k, v, frame)
                             for frame, start, stop in frame_runs(first, q.shape[2], self.per_frame)], dim=2)
        return self.to_tokens(out, query.shape[1], query.shape[2])

    def _frame(self, q, k, v, frame: int) -> torch.Tensor:
        if frame == 0:
            return attend(q, k, v)
        pose = slice((frame - 1) * self.per_frame, frame * self.per_frame)
        return attend(q, torch.cat([k, self.pose.key[:, :, pose]], dim=2),
                      torch.cat([v, self.pose.value[:, :, pose]], dim=2))


# ---------------------------------------------------------------------------------------------------------------
# The pose branch of one call

@dataclass
class PoseBranch:
    """This rank's pose tokens, advanced one block ahead of the video's (their keys / values feed it)."""

    hidden: torch.Tensor        # [b, n, dim] this rank's pose tokens
    attention: PoseAttention
    context: object             # wan.CrossContext of the pose prompt / CLIP features
    modulation: torch.Tensor    # [b, 6, dim] at the pose timestep

    def advance(self, block) -> None:
        self.hidden = block(self.hidden, self.context, self.modulation, self.attention)


def pose_tokens(model, inputs: dict, grid: VideoGrid, batch: int, seq: SeqParallel, ctx, dtype: torch.dtype
                ) -> Optional[tuple[torch.Tensor, VideoGrid, SeqShards]]:
    """(this rank's embedded pose tokens [b, n, dim], the pose grid, its shards), or None without pose_latents."""
    pose = inputs.get("pose_latents")
    if pose is None:
        return None
    pose = pad_to_patch_3d(ctx.to_device("pose_latents", pose, torch.float32), grid.patch)
    pose = pose.expand(batch, *pose.shape[1:]) if pose.shape[0] == 1 else pose
    pose_grid = VideoGrid(grid.frames - 1, grid.rows, grid.cols, grid.patch)
    shards = SeqShards.balanced(pose_grid.count, seq.degree)
    lo, hi = shards.range(seq.rank)
    ones = torch.ones_like(pose[:, :POSE_MASK_CHANNELS])
    patches = pose_grid.patches(torch.cat([pose, ones, pose], dim=1), lo, hi)
    return conv_patch_embed(model.patch_embedding, patches).to(dtype), pose_grid, shards


def pose_positions(pose_grid: VideoGrid, lo: int, hi: int, device) -> torch.Tensor:
    """(frame, row, col) rotary positions of pose tokens [lo, hi): ComfyUI's rope_encode_pose, frames from 1 (pose
    frame j beside video frame j + 1) and columns shifted by the grid's width."""
    shift = torch.tensor([1, 0, pose_grid.cols], device=device)
    return pose_grid.positions(lo, hi, device) + shift


def strength(inputs: dict, name: str) -> float:
    """pose_strength or reference_strength as ComfyUI passes them (absent = 1)."""
    value = inputs.get(name)
    return 1.0 if value is None else float(value)


def check_animate2_inputs(config, x: torch.Tensor, inputs: dict) -> None:
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
