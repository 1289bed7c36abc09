"""Flux.1's sequence-parallel plan: the image latents (output, then references) split over the ranks, the text
replicated and joined in every block's attention (double blocks through the added projections, single blocks as
the first tokens); ComfyUI's ids (images in the latent's dtype, text at 0) and its reference placements."""
from __future__ import annotations

import torch

from ...sp import AttentionSpec, Plan, Stage, Stream, image_parts, text_stream
from ...sp.tensor_parallel import SINGLE_STREAM
from ...sp.tokens import ROPE_THETA, as_list, reference_placements
from .detection import PATCH, REF_METHODS


def check(call) -> None:
    inputs, x = call.inputs, call.x
    if inputs.get("attention_mask") is not None:
        raise ValueError("attention_mask (regional prompting) is not supported by the sequence-parallel Flux")
    if inputs.get("control") is not None:
        raise ValueError("ControlNet inputs are not supported by the sequence-parallel Flux")
    channels = call.config.in_channels // (PATCH * PATCH)
    if x.dim() != 4 or x.shape[1] != channels:
        raise ValueError(f"x has shape {tuple(x.shape)}; this Flux takes [B, {channels}, H, W]")
    for number, ref in enumerate(as_list(inputs.get("ref_latents"))):
        if ref.dim() != 4 or ref.shape[1] != channels:
            raise ValueError(f"ref_latents[{number}] has shape {tuple(ref.shape)}; expected [B, {channels}, h, w]")
    context = inputs.get("context")
    if context is None or context.dim() != 3:
        raise ValueError("Flux needs context [batch, text tokens, features] (the T5 output)")


def image_and_text(call, patch: int, placements, default_method: str, text_ids, id_dtype,
                   text_embed="context_embedder") -> list[Stream]:
    """The output latent and its references (split), then the text (replicated); placements(method, x_hw, refs_hw)
    places the references (the call's method, else the load option's, else default_method), text_ids(length,
    device) gives the text's position ids, text_embed embeds the text (a model attribute or (model, raw) -> states)."""
    refs = as_list(call.inputs.get("ref_latents"))
    method = (call.inputs.get("ref_latents_method") or call.options.get("ref_latents_method")
              or default_method)
    found = placements(method, tuple(call.x.shape[-2:]), [r.shape[-2:] for r in refs])
    latents = [call.input("x")] + [call.ctx.to_device(f"ref_latents.{n}", ref, call.dtype)
                                   for n, ref in enumerate(refs)]
    axes = len(call.config.axes_dims_rope)
    image = image_parts(latents, [(0, 0, 0), *found], patch, False, id_dtype, axes, "x_embedder",
                        rope_options=call.inputs.get("rope_options"))
    text = call.input("context")
    return [Stream("image", image), text_stream(text, text_ids(text.shape[1], call.device), text_embed)]


def layout(call) -> list[Stream]:
    """ComfyUI's Flux ids: images in the latent's dtype, text at 0."""
    return image_and_text(call, PATCH, placements, "offset", text_ids, call.x.dtype)


def placements(method: str, x_hw, refs_hw) -> list[tuple[int, int, int]]:
    return reference_placements(method, tuple(x_hw), list(refs_hw), PATCH, REF_METHODS)


def text_ids(length: int, device) -> torch.Tensor:
    return torch.zeros(length, 3, device=device)


def condition(call) -> None:
    """The time / guidance / pooled-text embedding; ComfyUI leaves the guidance term out when none is given."""
    config, embed = call.config, call.model.time_text_embed
    sigma, guidance = call.sigma() * 1000, call.inputs.get("guidance")
    pooled = _pooled(call.inputs.get("y"), config.pooled_projection_dim, call)
    if config.guidance_embeds and guidance is not None:  # the guidance arrives in the model's dtype
        guidance = per_item(call.ctx.to_device("guidance", guidance.reshape(-1), call.dtype), call.batch)
        call.temb = embed(sigma, guidance * 1000, pooled)
    elif config.guidance_embeds:
        call.temb = embed.timestep_embedder(embed.time_proj(sigma).to(pooled.dtype)) + embed.text_embedder(pooled)
    else:
        call.temb = embed(sigma, pooled)


def joint_block(block, call) -> None:
    call.text, call.image = block(hidden_states=call.image, encoder_hidden_states=call.text, temb=call.temb)


PLAN = Plan(check=check, layout=layout, rope=lambda config: (config.axes_dims_rope, ROPE_THETA), condition=condition,
            stages=(Stage("transformer_blocks", joint_block),
                    Stage("single_transformer_blocks", joint_block, attention=AttentionSpec(text_prefix=True))),
            head=lambda call: call.model.proj_out(call.model.norm_out(call.image, call.temb)),
            tensor_parallel=SINGLE_STREAM)


def per_item(values: torch.Tensor, batch: int) -> torch.Tensor:
    return values.expand(batch) if values.numel() == 1 else values


def _pooled(y, width: int, call) -> torch.Tensor:
    """ComfyUI's y (CLIP pooled output), cut to the model's width; zeros when absent, as ComfyUI does."""
    if y is None:
        return torch.zeros(call.batch, width, device=call.device, dtype=call.dtype)
    y = call.ctx.to_device("y", y, call.dtype)[:, :width]
    return y.expand(call.batch, -1) if y.shape[0] == 1 else y
