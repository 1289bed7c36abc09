"""Chroma sequence-parallel plan: flux.PLAN with Chroma's differences. The image tokens split, the T5
text replicated (its padding masked as keys where ComfyUI passes a mask) and joined in every block; each block's
modulation is its slice of the distilled guidance network's output (ComfyUI's get_modulations: single blocks first,
then the double blocks' image and text halves, the final layer's last); single blocks take the joined sequence."""
from __future__ import annotations

from dataclasses import replace

import torch

from ...sp import Stage
from ...sp.tokens import as_list, text_key_mask
from ..flux import plan as flux

PATCH = 2


def check(call) -> None:
    """flux.check's refusals, but the text padding mask is served (ComfyUI's Chroma attends with it)."""
    if as_list(call.inputs.get("ref_latents")):
        raise ValueError("ref_latents (Kontext-style reference images) are not supported by Chroma")
    flux.check(_Unmasked(call))


class _Unmasked:
    """The call as flux.check reads it, without the attention mask (layout() checks the mask's shape)."""

    def __init__(self, call):
        self.inputs = {key: value for key, value in call.inputs.items() if key != "attention_mask"}
        self.x, self.config = call.x, call.config


def layout(call):
    streams = flux.layout(call)
    text = streams[-1]
    mask = call.inputs.get("attention_mask")
    mask = None if mask is None else call.ctx.to_device("attention_mask", mask)
    text.key_mask = text_key_mask(mask, call.batch, text.total)
    return streams


def condition(call) -> None:
    """The guidance network on (timestep, guidance, modulation index) embeddings, as ComfyUI's Chroma computes it
    (both scaled by 1000; ComfyUI's default guidance is 0), sliced per block."""
    model, batch = call.model, call.batch
    embed = model.time_text_embed
    guidance = call.inputs.get("guidance")
    guidance = torch.zeros(batch, device=call.device) if guidance is None else \
        call.ctx.to_device("guidance", guidance.reshape(-1), torch.float32).expand(batch)
    steps = embed.time_proj(call.sigma() * 1000).to(call.dtype)
    strength = embed.guidance_proj(guidance * 1000).to(call.dtype)
    index = embed.mod_proj.to(call.device, call.dtype).expand(batch, -1, -1)
    pair = torch.cat([steps, strength], dim=1)[:, None].expand(-1, index.shape[1], -1)
    vectors = model.distilled_guidance_layer(torch.cat([pair, index], dim=-1))
    single, double = len(model.single_transformer_blocks), len(model.transformer_blocks)
    call.modulation = {block: vectors[:, 3 * i:3 * i + 3] for i, block in enumerate(model.single_transformer_blocks)}
    for i, block in enumerate(model.transformer_blocks):
        image, text = 3 * single + 6 * i, 3 * single + 6 * double + 6 * i
        call.modulation[block] = torch.cat([vectors[:, image:image + 6], vectors[:, text:text + 6]], dim=1)
    call.final = vectors[:, -2:]


def double_block(block, call) -> None:
    call.text, call.image = block(hidden_states=call.image, encoder_hidden_states=call.text,
                                  temb=call.modulation[block])


def single_block(block, call) -> None:
    length = call.text.shape[1]
    joint = block(hidden_states=torch.cat([call.text, call.image], dim=1), temb=call.modulation[block])
    call.text, call.image = joint[:, :length], joint[:, length:]


PLAN = replace(flux.PLAN, check=check, layout=layout, condition=condition,
               stages=(Stage("transformer_blocks", double_block),
                       replace(flux.PLAN.stages[1], run=single_block)),
               head=lambda call: call.model.proj_out(call.model.norm_out(call.image, call.final)))
