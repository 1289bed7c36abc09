"""Mage-Flow's sequence-parallel plan: Qwen-Image's (qwen_image.PLAN: its blocks, text replicated with its padding
mask and joined in every block, the head) with Mage's tokens and time. One token per latent pixel of the 4-D latent
and of each reference (Edit), all split over the ranks, at rotary index 0 (the output) and 1 .. N (the references),
rows and columns centred at -ceil(n / 2); the text at position 0 on every axis (not rotated); the timestep embedded
in the compute dtype, as ComfyUI's MageFlowTransformer2DModel does."""
from __future__ import annotations

from dataclasses import replace

import torch

from ...sp import Stream, image_parts, text_stream
from ...sp.tokens import as_list, text_key_mask
from .. import qwen_image
from .detection import LATENT_CHANNELS

REFUSED_INPUTS = ("control",)  # ComfyUI's ControlNet residuals (no Mage-Flow ControlNet is released)


def check(call) -> None:
    for name in REFUSED_INPUTS:
        if call.inputs.get(name) is not None:
            raise ValueError(f"{name} is not supported by the sequence-parallel Mage-Flow")
    channels = call.model.config.in_channels
    _check_latent(call.x, "x", channels)
    for number, ref in enumerate(as_list(call.inputs.get("ref_latents"))):
        _check_latent(ref, f"ref_latents[{number}]", channels)
    context = call.inputs.get("context")
    if context is None or context.dim() != 3:
        raise ValueError("Mage-Flow needs context [batch, text tokens, features] (the text encoder output)")


def layout(call) -> list[Stream]:
    """The latent and its references (ComfyUI ignores ref_latents_method for Mage-Flow: always by index), then the
    text at position 0."""
    refs = [call.ctx.to_device(f"ref_latents.{n}", ref, call.dtype)
            for n, ref in enumerate(as_list(call.inputs.get("ref_latents")))]
    latents = [call.input("x"), *refs]
    image = image_parts(latents, [centred(index, latent) for index, latent in enumerate(latents)], 1, False,
                        torch.float32, 3, "img_in", outputs=1)
    text = call.input("context")
    ids = torch.zeros(text.shape[1], 3, device=call.device)
    mask = text_key_mask(call.inputs.get("attention_mask"), call.x.shape[0], text.shape[1])
    call.text_mask = None if mask is None else mask.to(call.device)
    return [Stream("image", image), text_stream(text, ids, _embed_text, call.text_mask)]


def centred(index: int, latent: torch.Tensor) -> tuple[int, int, int]:
    """(index, first row, first column): Mage centres n positions on [-ceil(n / 2), floor(n / 2)) (Qwen-Image on
    -floor(n / 2))."""
    rows, cols = latent.shape[-2:]
    return index, rows // 2 - rows, cols // 2 - cols


def _embed_text(model, text: torch.Tensor) -> torch.Tensor:
    return model.txt_in(model.txt_norm(text))


def condition(call) -> None:
    """ComfyUI's Mage embeds the timestep in the compute dtype (its frequency table too), as diffusers' embedding
    does (Qwen-Image's ComfyUI model: from float32)."""
    call.zero_refs, call.modulate_index = False, None  # what qwen_image's block and head read
    call.temb = call.model.time_text_embed(call.sigma().to(call.image.dtype), call.image)


PLAN = replace(qwen_image.PLAN, check=check, layout=layout, condition=condition, control=None)


def _check_latent(latent: torch.Tensor, name: str, channels: int) -> None:
    if latent.dim() != 4 or latent.shape[1] != channels:
        raise ValueError(f"{name} has shape {tuple(latent.shape)}; this Mage-Flow takes [B, {channels}, H, W] "
                         f"(the released one Flux.2's latent of {LATENT_CHANNELS} channels)")
