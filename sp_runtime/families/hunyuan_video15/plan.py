"""HunyuanVideo 1.5's sequence-parallel plan: HunyuanVideo 1.0's (hunyuan_video.PLAN) with its differences: the
image stream ([reference, video]) split as there; the text stream [SigLIP, ByT5, Qwen tokens], each with its
condition-type embedding, replicated; double-stream blocks only, no token replace; the meanflow time embedding."""
from __future__ import annotations

from dataclasses import replace

import torch

from ...sp import Stream, text_stream
from .. import hunyuan_video
from ..hunyuan_video.plan import (check_latent, check_reference, embedded, image_stream, patch_of, per_item,
                                  refined_text, text_keep, time_embedding)

TEXT, BYT5, IMAGE = 0, 1, 2  # condition types (rows of cond_type_embed)


def check(call) -> None:
    config, x, inputs = call.config, call.x, call.inputs
    check_latent(x, config.in_channels, patch_of(config), "this HunyuanVideo 1.5")
    streams = {"context": (config.text_embed_dim, "the Qwen2.5-VL tokens"),
               "txt_byt5": (config.text_embed_2_dim, "the ByT5 tokens"),
               "clip_fea": (config.image_embed_dim, "the SigLIP image tokens")}
    for name, (width, what) in streams.items():
        value = inputs.get(name)
        if value is None and name != "context":
            continue  # ComfyUI leaves glyph and image tokens out when the prompt has none
        if value is None or value.dim() != 3 or value.shape[-1] != width:
            raise ValueError(f"HunyuanVideo 1.5 takes {name} [B, L, {width}] ({what}); got "
                             f"{None if value is None else list(value.shape)}")
    check_reference(inputs.get("ref_latent"), x, config.in_channels, patch_of(config), "HunyuanVideo 1.5")
    timestep_r = inputs.get("timestep_r")
    if timestep_r is not None and timestep_r.numel() not in (1, x.shape[0]):
        raise ValueError(f"timestep_r has {timestep_r.numel()} values; HunyuanVideo 1.5 takes one or one per batch "
                         f"item ({x.shape[0]})")


def layout(call) -> list[Stream]:
    """The image stream as 1.0's; the text stream [SigLIP image tokens, ByT5 tokens, refined Qwen tokens], each with
    its condition-type embedding, its keep-mask covering the Qwen tokens."""
    model, batch, dtype = call.model, call.batch, call.dtype
    context = per_item(call.input("context"), batch)
    keep = text_keep(call, context.shape[1])
    types = model.cond_type_embed.weight.to(dtype)
    parts = [refined_text(model.context_embedder, context, call.sigma(), keep) + types[TEXT]]
    if call.inputs.get("txt_byt5") is not None:
        parts.insert(0, model.context_embedder_2(per_item(call.input("txt_byt5"), batch)) + types[BYT5])
    if call.inputs.get("clip_fea") is not None:
        parts.insert(0, model.image_embedder(per_item(call.input("clip_fea"), batch)) + types[IMAGE])
    text = torch.cat(parts, dim=1)
    if keep is not None and text.shape[1] > keep.shape[1]:
        keep = torch.cat([keep.new_ones(batch, text.shape[1] - keep.shape[1]), keep], dim=1)
    return [image_stream(call), text_stream(text, None, embedded, keep)]


def condition(call) -> None:
    """The timestep's embedding, plus (meanflow models, when the call gives timestep_r) the next sigma's through the
    second embedder: ComfyUI's HunyuanVideo 1.5 sums them (meanflow_sum), as diffusers does."""
    embed, timestep_r = call.model.time_embed, call.inputs.get("timestep_r")
    call.temb = time_embedding(embed, call.sigma(), call.dtype)
    if embed.timestep_embedder_r is not None and timestep_r is not None:
        values = per_item(call.ctx.to_device("timestep_r", timestep_r.reshape(-1), torch.float32), call.batch)
        call.temb = call.temb + embed.timestep_embedder_r(embed.time_proj_r(values).to(call.dtype))


def double_block(block, call) -> None:
    call.image, call.text = block(call.image, call.text, call.temb, None, None)


PLAN = replace(hunyuan_video.PLAN, check=check, layout=layout, condition=condition,
               stages=(replace(hunyuan_video.PLAN.stages[0], run=double_block),),
               head=lambda call: call.model.proj_out(call.model.norm_out(call.image, call.temb)),
               )
