"""Qwen-Image's sequence-parallel plan: the output latent's frames and the references split over the ranks, the
text replicated (with its padding mask) and joined in every block; Edit-2511 modulates the reference tokens at
timestep 0 (per-token conditioning); Layered's frames sit at rotary index 0 .. T-1 and its input image at -1."""
from __future__ import annotations

from typing import Optional

import torch

from ...sp import Control, Plan, Stage, Stream, image_parts, text_stream
from ...sp.tensor_parallel import GENERIC
from ...sp.tokens import ROPE_THETA, as_list, reference_placements, text_key_mask
from .detection import PATCH, REF_METHODS


def default_ref_method(config) -> str:
    """Where reference latents go when the call names no method, as ComfyUI's detection sets it per variant:
    Layered puts the input image at index -1 (its layers are frames 0 .. T-1), Edit-2511 at index 1 with timestep 0,
    the others at index 1."""
    if config.use_additional_t_cond:
        return "negative_index"
    return "index_timestep_zero" if config.zero_cond_t else "index"


def check(call) -> None:
    _check_unsupported(call.inputs)
    _check_latent(call.model, call.x)
    context = call.inputs.get("context")
    if context is None or context.dim() != 3:
        raise ValueError("Qwen-Image needs context [batch, text tokens, features] (the text encoder output)")
    for ref in as_list(call.inputs.get("ref_latents")):
        as_4d(ref, "ref_latents")


def layout(call) -> list[Stream]:
    """Frames at rotary index 0 .. T-1 (ComfyUI), references placed by the method, text ids after the centred
    image; the text mask is checked on the host (no device sync)."""
    x, inputs = call.x, call.inputs
    frames = _frames(call.input("x"))
    refs = as_list(inputs.get("ref_latents"))
    call.method = (inputs.get("ref_latents_method") or call.options.get("ref_latents_method")
                   or default_ref_method(call.config))
    places = reference_placements(call.method, tuple(x.shape[-2:]), [as_4d(r, "").shape[-2:] for r in refs], PATCH,
                                  REF_METHODS)
    refs = [as_4d(call.ctx.to_device(f"ref_latents.{n}", ref, call.dtype), "ref_latents")
            for n, ref in enumerate(refs)]
    call.zero_refs = call.method == "index_timestep_zero" and bool(refs)
    image = image_parts(frames + refs, [(frame, 0, 0) for frame in range(len(frames))] + places, PATCH, True,
                        x.dtype, 3, "img_in", outputs=len(frames))
    text = call.input("context")
    grid = image[0].output.grid
    start = max(grid.rows // 2, grid.cols // 2)  # ComfyUI: text ids follow the centred image
    ids = torch.arange(start, start + text.shape[1], device=call.device, dtype=torch.float32)[:, None].expand(-1, 3)
    mask = text_key_mask(inputs.get("attention_mask"), x.shape[0], text.shape[1])
    call.text_mask = None if mask is None else mask.to(call.device)
    return [Stream("image", image), text_stream(text, ids, _embed_text, call.text_mask)]


def _embed_text(model, text: torch.Tensor) -> torch.Tensor:
    return model.txt_in(model.txt_norm(text))


def condition(call) -> None:
    """ComfyUI embeds the timestep from float32 sigma (diffusers would round it to the compute dtype first)."""
    sigma, call.modulate_index = call.sigma(), None
    t_cond = _time_condition(call.model, call.inputs.get("additional_t_cond"), call.batch, call.ctx)
    if call.zero_refs:
        sigma, t_cond = torch.cat([sigma, sigma * 0]), None if t_cond is None else t_cond.repeat(2)
        references = call.shards["image"].flags(lambda part: part.output is None, call.device)
        call.modulate_index = references.int()[None].expand(call.batch, -1)
    call.temb = call.model.time_text_embed(sigma, call.image, t_cond)


def block(block, call) -> None:
    block.zero_cond_t = call.zero_refs  # diffusers' blocks read this flag for the text modulation
    call.text, call.image = block(hidden_states=call.image, encoder_hidden_states=call.text,
                                  encoder_hidden_states_mask=call.text_mask, temb=call.temb,
                                  modulate_index=call.modulate_index)


def head(call) -> torch.Tensor:
    temb = call.temb.chunk(2, dim=0)[0] if call.zero_refs else call.temb
    return call.model.proj_out(call.model.norm_out(call.image, temb))


PLAN = Plan(check=check, layout=layout, rope=lambda config: (config.axes_dims_rope, ROPE_THETA), condition=condition,
            stages=(Stage("transformer_blocks", block),), head=head, tensor_parallel=GENERIC,
            control=Control("transformer_blocks", "image", ("qwen_image_controlnet",)))


def _time_condition(model, value, batch: int, ctx) -> Optional[torch.Tensor]:
    """Layered's additional_t_cond as long [batch] (0 when not given, as ComfyUI); None for models without it
    (ComfyUI reads past it there too)."""
    if not model.config.use_additional_t_cond:
        return None
    if value is None:
        return torch.zeros(batch, dtype=torch.long, device=ctx.device)
    value = torch.as_tensor(value).reshape(-1)
    if value.numel() not in (1, batch) or value.is_floating_point() or bool(((value < 0) | (value > 1)).any()):
        raise ValueError(f"additional_t_cond must be 0 or 1 per batch item (Qwen-Image-Layered's two time "
                         f"embeddings); got {value.tolist()}")
    return ctx.to_device("additional_t_cond", value.long().expand(batch))


def _check_latent(model, x: torch.Tensor) -> tuple[int, int]:
    if x.dim() not in (4, 5):
        raise ValueError(f"x has shape {tuple(x.shape)}; Qwen-Image takes [B, C, T, H, W] (T = 1, or the layers of "
                         f"Qwen-Image-Layered)")
    channels, height, width = x.shape[1], x.shape[-2], x.shape[-1]
    if channels * PATCH * PATCH != model.config.in_channels:
        raise ValueError(f"x has {channels} channels but this Qwen-Image takes "
                         f"{model.config.in_channels // (PATCH * PATCH)}")
    return height, width


def _check_unsupported(inputs: dict) -> None:
    for name in ("control", "eligen_entity_prompt_emb", "eligen_entity_masks"):  # ControlNets: input controlnets
        if inputs.get(name) is not None:
            raise ValueError(f"{name} is not supported by the sequence-parallel Qwen-Image")


def _frames(latent: torch.Tensor) -> list[torch.Tensor]:
    """[B, C, T, H, W] (ComfyUI's Qwen latents) or [B, C, H, W] -> its T frames [B, C, H, W] (views)."""
    return list(latent.unbind(2)) if latent.dim() == 5 else [latent]


def as_4d(latent: torch.Tensor, name: str) -> torch.Tensor:
    """[B, C, 1, H, W] (ComfyUI's Qwen latents) or [B, C, H, W] -> [B, C, H, W] view."""
    if latent.dim() == 5:
        if latent.shape[2] != 1:
            raise ValueError(f"{name} has {latent.shape[2]} frames; Qwen-Image takes one frame ([B, C, 1, H, W])")
        return latent[:, :, 0]
    if latent.dim() != 4:
        raise ValueError(f"{name} has shape {tuple(latent.shape)}; Qwen-Image takes [B, C, 1, H, W]")
    return latent
