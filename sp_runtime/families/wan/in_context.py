"""Wan in-context references (Wan 2.2 Bernini-R, a Wan 2.2 A14B T2V fine-tune with no modules of its own): ComfyUI's
`context_latents`, a list of latents [B or 1, C, T_i, H_i, W_i] (BerniniConditioning's source video, reference video
and reference images, each at its own size), patch-embedded by the model's own patch_embedding.

Under SP each latent is a part of the video stream after the video (never output), at a rotary grid of its own from
(0, 0, 0); ComfyUI composes into the rotary of latent i a rotation by source id i + 1 over the whole head, Wan's
1-axis rotary at position i + 1 (angles add), applied here to this rank's share of the tables.
"""
from __future__ import annotations

import torch

from ...sp import video_part
from ...sp.rope_options import rotary_axis
from ...sp.video_tokens import pad_to_patch_3d
from .plan import ROPE_THETA, patch_embedder, per_item
from .variants import Variant, register

SERVED = ("t2v",)  # Bernini-R's architecture; other Wan variants refuse context_latents by name (plan.check)


def _latents(call) -> list:
    latents = call.inputs.get("context_latents")
    return [] if latents is None else list(latents) if isinstance(latents, (list, tuple)) else [latents]


def check(call) -> None:
    channels = call.config.in_channels
    for index, latent in enumerate(_latents(call)):
        if (not isinstance(latent, torch.Tensor) or latent.dim() != 5 or latent.shape[1] != channels
                or latent.shape[0] not in (1, call.batch)):
            shape = list(latent.shape) if isinstance(latent, torch.Tensor) else type(latent).__name__
            raise ValueError(f"context_latents[{index}] has shape {shape}; this Wan takes latents "
                             f"[B or 1, {channels}, T, H, W] (one per in-context source, each of any size)")


def layout(call, streams) -> None:
    """One part per context latent after the video's, and which tokens of the stream carry which source id."""
    patch = tuple(call.config.patch_size)
    video = streams[0]
    call.source_ids = []  # (first token, token count, source id)
    for index, latent in enumerate(_latents(call)):
        latent = per_item(pad_to_patch_3d(call.ctx.to_device(f"context_latents.{index}", latent, torch.float32),
                                          patch), call.batch)
        part = video_part(latent, patch, patch_embedder(call), output=False)
        call.source_ids.append((video.total, part.count, index + 1))
        video.parts.append(part)


def prepare(call) -> None:
    """This rank's rotary of the context tokens turned by their source id (cos / sin of summed angles)."""
    shard = call.shards["video"]
    if not getattr(call, "source_ids", None) or shard.rope is None:
        return
    ids = torch.zeros(shard.hi - shard.lo, dtype=torch.float64)
    for first, count, source in call.source_ids:
        lo, hi = max(first, shard.lo), min(first + count, shard.hi)
        if lo < hi:
            ids[lo - shard.lo:hi - shard.lo] = source
    cos, sin = shard.rope
    turn_cos, turn_sin = (part.to(cos.device, cos.dtype) for part in rotary_axis(ids, cos.shape[-1], ROPE_THETA))
    shard.rope = (cos * turn_cos - sin * turn_sin, sin * turn_cos + cos * turn_sin)


IN_CONTEXT = register(Variant(
    "in_context", applies=lambda model, variant: variant in SERVED, inputs={name: ("context_latents",)
                                                                            for name in SERVED},
    tensor_parallel=True, check=check, layout=layout, prepare=prepare))
