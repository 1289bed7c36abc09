"""HunyuanVideo 1.0's sequence-parallel plan (HunyuanVideo 1.5's is this one with its differences): the image
tokens [reference, video] split, each rank patch-embedding its own share; the refined text replicated, after the
image tokens in every block's joint attention (single blocks project it like the image); token replace modulates
this rank's first-frame tokens. Where ComfyUI and diffusers differ we follow ComfyUI: the refiner's pooled text is
the plain mean of all tokens (padding included), and the token-replace embedding gets the guidance term and also
modulates the final layer."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from ...sp import AttentionSpec, Plan, Stage, Stream, project_qkv, text_stream, video_part
from ...sp.tensor_parallel import SINGLE_STREAM
from ...sp.tokens import text_key_mask
from ...sp.video_tokens import conv_patch_embed
from .detection import ROPE_THETA

UNSUPPORTED_INPUTS = {"txt_byt5": "ByT5 glyph text (HunyuanImage 2.1)"}


def check(call) -> None:
    config, x, inputs = call.config, call.x, call.inputs
    patch = patch_of(config)
    check_latent(x, config.in_channels, patch, "this HunyuanVideo")
    context = inputs.get("context")
    if context is None or context.dim() != 3 or context.shape[-1] != config.text_embed_dim:
        shape = None if context is None else list(context.shape)
        raise ValueError(f"HunyuanVideo needs context [B, L, {config.text_embed_dim}] (the text encoder's tokens); "
                         f"got {shape}")
    y = inputs.get("y")
    if y is None or y.dim() != 2 or y.shape[-1] < config.pooled_projection_dim:
        raise ValueError(f"HunyuanVideo needs y [B, {config.pooled_projection_dim}] (the CLIP pooled output); got "
                         f"{None if y is None else list(y.shape)}")
    for name, what in UNSUPPORTED_INPUTS.items():
        if inputs.get(name) is not None:
            raise ValueError(f"{name} ({what}) is not supported by the sequence-parallel HunyuanVideo")
    check_reference(inputs.get("ref_latent"), x, config.in_channels, patch, "HunyuanVideo")
    if inputs.get("ref_latent") is not None and inputs.get("guiding_frame_index") is not None:
        raise ValueError("ref_latent together with guiding_frame_index (token replace) is not supported by the "
                         "sequence-parallel HunyuanVideo: ComfyUI's blocks and final layer disagree there on which "
                         "tokens are the first frame's")


def check_reference(reference: Optional[torch.Tensor], x: torch.Tensor, channels: int, patch, name: str) -> None:
    """A ref_latent (if any) that x_embedder takes (x's channels, whole patches), one per batch item or one."""
    if reference is None:
        return
    check_latent(reference, channels, patch, f"this {name} (patch-embedding it like x)", "ref_latent")
    if reference.shape[0] not in (1, x.shape[0]):
        raise ValueError(f"ref_latent has batch {reference.shape[0]}; x has {x.shape[0]}: give one per item or one")


def check_latent(x: torch.Tensor, channels: int, patch: tuple[int, int, int], name: str, label: str = "x") -> None:
    """A [B, C, T, H, W] latent of whole patches (ComfyUI's HunyuanVideo models need them too); `label` names it."""
    if x.dim() != 5 or x.shape[1] != channels:
        raise ValueError(f"{label} has shape {list(x.shape)}; {name} takes [B, {channels}, T, H, W]")
    if any(size % p for size, p in zip(x.shape[2:], patch)):
        raise ValueError(f"{label} has frames, height, width {list(x.shape[2:])}, not multiples of {name}'s patch "
                         f"{list(patch)}: use a latent of whole patches (e.g. an image size divisible by 16)")


def patch_of(config) -> tuple[int, int, int]:
    return config.patch_size_t, config.patch_size, config.patch_size


def layout(call) -> list[Stream]:
    context = per_item(call.input("context"), call.batch)
    keep = text_keep(call, context.shape[1])
    text = refined_text(call.model.context_embedder, context, call.sigma(), keep)
    return [image_stream(call), text_stream(text, None, embedded, keep)]


def image_stream(call) -> Stream:
    """The video's tokens, led by ref_latent's when the call gives one: ComfyUI places those at frame -1, their
    columns shifted right by the video's width, and drops them from the output."""
    patch = patch_of(call.config)
    video = video_part(call.input("x"), patch, embed_patches)
    if call.inputs.get("ref_latent") is None:
        return Stream("image", [video])
    ahead = video_part(call.input("ref_latent"), patch, embed_patches, output=False)
    ahead.ids[:, 0] = -1
    ahead.ids[:, 2] += video.output.grid.cols
    return Stream("image", [ahead, video])


def embed_patches(model, patches: torch.Tensor) -> torch.Tensor:
    """x_embedder's Conv3d on this rank's patches, in the compute dtype (as ComfyUI)."""
    return conv_patch_embed(model.x_embedder.proj, patches, patches.dtype)


def embedded(model, states: torch.Tensor) -> torch.Tensor:
    """The text stream's embedder: its tokens are embedded (refined) whole in the layout already."""
    return states


def text_keep(call, length: int) -> Optional[torch.Tensor]:
    """The call's attention_mask as a text keep-mask on the device (None: every token kept)."""
    keep = text_key_mask(call.inputs.get("attention_mask"), call.batch, length)
    return None if keep is None else keep.to(call.device)


def refined_text(refiner, context: torch.Tensor, sigma: torch.Tensor, keep: Optional[torch.Tensor]) -> torch.Tensor:
    """The token refiner on the whole text, as ComfyUI runs it: pooled over every token (padding too) and every
    token attending to the kept ones. diffusers' refiners pool over kept tokens only and mask padded queries
    (1.5: into NaN rows), so their blocks run here with a keys-only mask."""
    embedding = refiner.time_text_embed(sigma, context.mean(dim=1))
    hidden = refiner.proj_in(context)
    mask = None if keep is None else keep[:, None, None, :]
    for block in refiner.token_refiner.refiner_blocks:
        hidden = block(hidden, embedding, mask)
    return hidden


def condition(call) -> None:
    """temb = time + pooled CLIP + guidance; token replace: replace_temb (the guiding frame index's time instead)
    for the `replaced` first-frame tokens that lead this rank's share."""
    embed, dtype = call.model.time_text_embed, call.dtype
    y = per_item(call.input("y"), call.batch)
    pooled = embed.text_embedder(y[:, :call.config.pooled_projection_dim])  # ComfyUI cuts y to the model's width
    guidance = _guidance_term(embed, call)
    call.temb = time_embedding(embed, call.sigma(), dtype) + pooled + guidance
    call.replace_temb, call.replaced = call.temb, 0
    index = call.inputs.get("guiding_frame_index")
    if index is not None:
        index = per_item(call.ctx.to_device("guiding_frame_index", index.reshape(-1), torch.float32), call.batch)
        call.replace_temb = time_embedding(embed, index, dtype) + pooled + guidance
        shard = call.shards["image"]
        call.replaced = max(0, min(shard.hi, shard.stream.parts[-1].output.grid.per_frame) - shard.lo)


def _guidance_term(embed, call):
    """The embedded guidance (x 1000, ComfyUI's timestep_embedding factor), or 0 when the model has no guidance
    embedding or the call gives none (ComfyUI leaves it out then)."""
    guidance = call.inputs.get("guidance")
    if embed.guidance_embedder is None or guidance is None:
        return 0
    values = per_item(call.ctx.to_device("guidance", guidance.reshape(-1), torch.float32), call.batch) * 1000
    return embed.guidance_embedder(embed.time_proj(values).to(call.dtype))


def time_embedding(embedder, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """diffusers' sinusoidal projection + MLP of timestep-like values [B] (ComfyUI's timestep_embedding, factor 1)."""
    return embedder.timestep_embedder(embedder.time_proj(values).to(dtype))


def per_item(tensor: torch.Tensor, batch: int) -> torch.Tensor:
    """An input with one row per batch item; a batch-1 (or 0-D) input serves every item."""
    tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor
    return tensor.expand(batch, *tensor.shape[1:]) if tensor.shape[0] == 1 else tensor


def token_replace_block(block, call) -> None:
    """diffusers' token-replace blocks (double and single): with no token replaced they compute the plain blocks."""
    call.image, call.text = block(call.image, call.text, call.temb, None, None, call.replace_temb, call.replaced)


def head(call) -> torch.Tensor:
    """The output AdaLayerNorm and projection; ComfyUI's final layer modulates token-replace tokens with their own
    embedding."""
    norm, hidden, replaced = call.model.norm_out, call.image, call.replaced
    if replaced:
        hidden = torch.cat([norm(hidden[:, :replaced], call.replace_temb), norm(hidden[:, replaced:], call.temb)],
                           dim=1)
    else:
        hidden = norm(hidden, call.temb)
    return call.model.proj_out(hidden)


def unpatch_order(call, tokens: torch.Tensor) -> torch.Tensor:
    """proj_out's features (c, pt, ph, pw) -> VideoGrid.write's (pt, ph, pw, c)."""
    return tokens.unflatten(-1, (call.config.out_channels, -1)).transpose(-1, -2).flatten(-2)


def _text_like_image(attn, text: torch.Tensor) -> list[torch.Tensor]:
    """Single-stream blocks project the text with the image's projections and norms."""
    return project_qkv(attn, text)[0]


IMAGE_FIRST = AttentionSpec(text_first=False)
PLAN = Plan(check=check, layout=layout, condition=condition, rope=lambda config: (config.rope_axes_dim, ROPE_THETA),
            stages=(Stage("transformer_blocks", token_replace_block, attention=IMAGE_FIRST),
                    Stage("single_transformer_blocks", token_replace_block,
                          attention=replace(IMAGE_FIRST, project_text=_text_like_image))),
            head=head, output_tokens=unpatch_order, tensor_parallel=SINGLE_STREAM)
