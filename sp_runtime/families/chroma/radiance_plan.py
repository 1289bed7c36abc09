"""Chroma Radiance's sequence-parallel plan: Chroma's plan on pixel patches, then the NeRF head.

Split: the image's pixel patches (P x P, padded circularly to whole patches), each rank embedding, transforming and
decoding only its own patches: the trunk's blocks (Chroma's), then the NeRF embedder and blocks, which are
token-local (a patch's pixels and its own trunk token). Replicated: the T5 text (ids 0, or 0..L-1 on the first axis
for files with ComfyUI's `__sequential__` marker), the guidance network's modulations. Gathered: the NeRF features
of every patch (all-gather over the sequence group, uneven shards trimmed), folded into the whole image, on which
every rank runs the final RMSNorm and 3x3 convolution (it reads across patch borders), the crop and, for x0 files
(`__x0__`), ComfyUI's (x - x0) / sigma; each rank then writes its own patches of that image.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from ...attention import gather_tokens
from ...sp.tokens import as_list, pad_to_patch, patchify, text_key_mask
from ..flux import plan as flux
from . import plan as chroma
from .radiance import final_layer, nerf


def check(call) -> None:
    inputs, x = call.inputs, call.x
    for name in ("ref_latents", "control"):
        if as_list(inputs.get(name)):
            raise ValueError(f"{name} is not supported by Chroma Radiance under sequence parallelism")
    channels = call.config.in_channels // call.model.radiance.pixel_patch ** 2
    if x.dim() != 4 or x.shape[1] != channels:
        raise ValueError(f"x has shape {tuple(x.shape)}; Chroma Radiance takes pixels [B, {channels}, H, W]")
    context = inputs.get("context")
    if context is None or context.dim() != 3:
        raise ValueError("Chroma Radiance needs context [batch, text tokens, features] (the T5 output)")


def layout(call):
    sequential = call.model.radiance.sequential_text_ids

    def text_ids(length: int, device) -> torch.Tensor:
        ids = torch.zeros(length, 3, device=device)
        if sequential:
            ids[:, 0] = torch.arange(length, device=device).to(call.x.dtype).float()
        return ids
    streams = flux.image_and_text(call, call.model.radiance.pixel_patch, flux.placements, "offset", text_ids,
                                  call.x.dtype)
    text = streams[-1]
    mask = call.inputs.get("attention_mask")
    text.key_mask = text_key_mask(None if mask is None else call.ctx.to_device("attention_mask", mask),
                                  call.batch, text.total)
    return streams


def head(call) -> torch.Tensor:
    """This rank's output patches: its NeRF features, everyone's gathered into the image, the final layer on it."""
    model, shard = call.model, call.shards["image"]
    patch, width = model.radiance.pixel_patch, model.radiance.nerf_hidden_size
    batch, count = call.batch, shard.hi - shard.lo
    raw = shard.stream.parts[0].tokens[:, shard.lo:shard.hi]  # [B, n, C*P*P], features (c, ph, pw)
    pixels = raw.reshape(batch * count, raw.shape[-1] // patch ** 2, patch * patch).transpose(1, 2)
    tokens = call.image.reshape(batch * count, call.image.shape[-1])
    features = nerf(model, pixels, tokens).reshape(batch, count, patch * patch * width)
    features = gather_tokens(features, shard.shards, call.seq)  # [B, N, P*P*width]
    grid = shard.stream.parts[0].output.grid
    image = features.reshape(batch, grid.rows, grid.cols, patch, patch, width).permute(0, 5, 1, 3, 2, 4)
    image = final_layer(model)(image.reshape(batch, width, grid.rows * patch, grid.cols * patch))
    image = image[:, :, :grid.height, :grid.width]
    if model.radiance.x0:  # ComfyUI's x0 files: the velocity (x - x0) / sigma
        sigma = call.sigma().view(-1, 1, 1, 1)
        image = (call.input("x", torch.float32) - image.float()) / sigma
    return patchify(pad_to_patch(image, patch), patch)[:, shard.lo:shard.hi]



PLAN = replace(chroma.PLAN, check=check, layout=layout, head=head)
