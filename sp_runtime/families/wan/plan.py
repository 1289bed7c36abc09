"""Wan 2.1 / 2.2's sequence-parallel plan for ComfyUI's `diffusion_model(x, timestep, context, clip_fea,
time_dim_concat)`: x [B, C, T, H, W] (I2V: 36 channels), timestep = sigma x 1000 as [B] or, for TI2V 5B with a
denoise mask, [B, T] per latent frame; context [B, L, 4096]; clip_fea [B, 257 or 514, 1280] for models with a CLIP
image embedder. Returns [B, out_channels, T, H, W].

PLAN: the "video" stream (x's patches, then time_dim_concat's frames, attended to and never output) split in
balanced shards, each rank patch-embedding its own (in float32, as ComfyUI) at their (frame, row, column) rotary
(ScaleROPE's rope_options applied); the per-frame timesteps spread over the tokens as ComfyUI's repeat_e; every
block's self-attention through sp_attention, its cross-attention local against the replicated text / image context
(Stage.local); the head on this rank's tokens. plan_for(variants) adds the hooks of a model's variants
(wan.variants).
"""
from __future__ import annotations

from functools import partial
from typing import Optional

import torch

from ...sp import AttentionSpec, Plan, Stage, Stream, video_part
from ...sp.tensor_parallel import NORM, Split, TensorParallelPlan
from ...sp.cross import Context
from ...sp.rope_options import is_identity, scaled_positions
from ...sp.video_tokens import conv_patch_embed, pad_to_patch_3d
from .variants import variant_inputs

ROPE_THETA = 10000.0  # diffusers' WanRotaryPosEmbed default (it keeps no theta attribute)


def plan_for(variants) -> Plan:
    """The plan of a Wan with these registered variants (none: PLAN)."""
    variants = tuple(variants)
    stage = Stage("blocks", partial(run_block, variants), attends="video", text=None, local=("attn2",),
                  attention=AttentionSpec(project=project_qkv), also=tuple(v for variant in variants for v in variant.also),
                  skips_in_run=True)
    return Plan(check=partial(check, variants), layout=partial(layout, variants),
                condition=partial(condition, variants), stages=(stage,), head=partial(run_head, variants), rope=rope, output="video",
                tensor_parallel=TENSOR_PARALLEL if all(v.tensor_parallel for v in variants) else
                f"its variant {', '.join(v.name for v in variants if not v.tensor_parallel)} is not checked at TP yet",
                comfy_blocks={"double_block": "blocks"})


# q / k norms span all heads: split with q / k, their mean square summed over the TP group; the blocks' own
# attention modules only (a variant's added attention, e.g. HuMo's audio cross-attention, stays whole)
TENSOR_PARALLEL = TensorParallelPlan(extra=tuple(Split(f"{attn}.{name}", NORM) for attn in ("attn1", "attn2")
                                                 for name in ("norm_q", "norm_k", "norm_added_k")))


def rope(config) -> tuple[tuple[int, int, int], float]:
    """diffusers' WanRotaryPosEmbed's (frame, row, column) rotary sizes."""
    spatial = 2 * (config.attention_head_dim // 6)
    return (config.attention_head_dim - 2 * spatial, spatial, spatial), ROPE_THETA


def project_qkv(attn, hidden: torch.Tensor):
    """q, k, v [B, S, H, D]: Wan's q / k norms span all heads (rms_norm_across_heads), so they come before the split."""
    qkv = (attn.norm_q(attn.to_q(hidden)), attn.norm_k(attn.to_k(hidden)), attn.to_v(hidden))
    return [tensor.unflatten(-1, (attn.heads, -1)) for tensor in qkv], None


def check(variants, call) -> None:
    config, x, inputs, variant = call.config, call.x, call.inputs, call.worker.info.variant
    if x.dim() != 5 or x.shape[1] != config.in_channels:
        raise ValueError(f"x has shape {list(x.shape)}; this Wan takes [B, {config.in_channels}, T, H, W]")
    context = inputs.get("context")
    if context is None or context.dim() != 3 or context.shape[-1] != config.text_dim:
        shape = None if context is None else list(context.shape)
        raise ValueError(f"Wan needs context [B, L, {config.text_dim}] (the text encoder output); got {shape}")
    taken = variant_inputs()
    refused = {name for names in taken.values() for name in names} - set(taken.get(variant, ()))
    for name in sorted(refused):
        if inputs.get(name) is not None:
            raise ValueError(f"{name} belongs to a Wan variant the sequence-parallel Wan does not support")
    for name in {"time_dim_concat", appended_input(variants)}:
        extra = inputs.get(name)
        if extra is not None and (extra.dim() != 5 or extra.shape[1] != x.shape[1] or extra.shape[3:] != x.shape[3:]):
            raise ValueError(f"{name} has shape {list(extra.shape)}; it must match x {list(x.shape)} in channels, "
                             f"height and width")
    for extension in variants:
        if not extension.rope_options and not is_identity(inputs.get("rope_options")):
            raise ValueError(f"ScaleROPE's rope_options are not applied to Wan {variant} models by ulysses-sp (their "
                             f"extra token streams have positions of their own): remove the ScaleROPE node")
        if extension.check is not None:
            extension.check(call)


def appended_input(variants) -> str:
    """The input whose frames follow x's (time_dim_concat, e.g. Phantom subjects; HuMo's reference_latent)."""
    return next((v.appended for v in variants if v.appended != "time_dim_concat"), "time_dim_concat")


def layout(variants, call) -> list[Stream]:
    patch = tuple(call.config.patch_size)
    latent = pad_to_patch_3d(call.input("x", torch.float32), patch)
    name = appended_input(variants)
    if call.inputs.get(name) is not None:
        extra = pad_to_patch_3d(per_item(call.input(name, torch.float32), call.batch), patch)
        latent = torch.cat([latent, extra], dim=2)
    streams = [Stream("video", [video_part(latent, patch, patch_embedder(call))])]
    for variant in variants:
        if variant.layout is not None:
            variant.layout(call, streams)
    rope_options = call.inputs.get("rope_options")
    if not is_identity(rope_options):
        for part in streams[0].parts:
            part.ids = scaled_positions(part.ids, rope_options)
    return streams


def patch_embedder(call, conv: str = "patch_embedding"):
    """A part's embedder: the Conv3d as a linear over its patches in float32 (as ComfyUI), in the compute dtype."""
    return lambda model, patches: conv_patch_embed(model.get_submodule(conv), patches).to(call.dtype)


def condition(variants, call) -> None:
    """The text / image context, the (per-token) modulations of this rank's tokens, then the variants' embed and
    prepare hooks."""
    model, dtype = call.model, call.dtype
    call.context = cross_context(call, "context", "clip_fea")
    sigma = per_item(call.ctx.to_device("timestep", call.timestep, torch.float32), call.batch)
    for variant in variants:
        if variant.timesteps is not None:
            sigma = variant.timesteps(call, sigma)
    temb, projection = time_embeddings(model, sigma, dtype)
    shard = call.shards["video"]
    entries = token_entries(temb.shape[1], shard.stream.total, shard.lo, shard.hi, call.device)
    if entries is None:
        call.block_modulation, call.out_modulation = projection[:, 0], temb
    else:
        call.block_modulation, call.out_modulation = projection[:, entries], temb[:, entries]
    call.block_index = 0
    for hook in ("embed", "prepare"):
        for variant in variants:
            if getattr(variant, hook) is not None:
                getattr(variant, hook)(call)


def run_block(variants, block, call) -> None:
    """One main block on this rank's tokens, the variants' hooks around it (or a variant's block instead); a block
    in call.skip (SkipLayerGuidanceDiT) is left out, its hooks run, as ComfyUI's Wan models do."""
    index = call.block_index
    call.block_index += 1
    for variant in variants:
        if variant.before is not None:
            variant.before(call, index, block)
    override = next((variant.block for variant in variants if variant.block is not None), None)
    if index in call.skip:
        pass
    elif override is not None:
        call.video = override(block, call)
    else:
        call.video = block(call.video, call.context, call.block_modulation, None)
    for variant in variants:
        if variant.after is not None:
            variant.after(call, index, block)


def run_head(variants, call) -> torch.Tensor:
    """A variant's head (Wan Dancer's global head) or the stock one."""
    override = next((variant.head for variant in variants if variant.head is not None), head)
    return override(call)


def head(call, table: Optional[torch.Tensor] = None, projection=None) -> torch.Tensor:
    """norm_out modulated by the (per-token) time embedding, then proj_out (or the table and projection given):
    [b, n, pt*ph*pw*out_channels]."""
    model, hidden, modulation = call.model, call.video, call.out_modulation
    table = model.scale_shift_table if table is None else table
    projection = model.proj_out if projection is None else projection
    if call.block_modulation.dim() == 3:  # one modulation for every token
        shift, scale = (table + modulation).chunk(2, dim=1)
    else:  # per-token modulation (Wan 2.2 TI2V 5B with per-frame timesteps)
        shift, scale = (table.unsqueeze(0) + modulation.unsqueeze(2)).chunk(2, dim=2)
        shift, scale = shift.squeeze(2), scale.squeeze(2)
    hidden = (model.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden)
    return projection(hidden)


def cross_context(call, text_input: str, image_input: str) -> Context:
    """The embedded text and image context of the cross-attention (replicated on every rank)."""
    model = call.model
    text = model.condition_embedder.text_embedder(per_item(call.input(text_input), call.batch))
    if model.condition_embedder.image_embedder is None:
        return Context(text, None)  # ComfyUI ignores clip_fea for models without an image embedder
    if call.inputs.get(image_input) is None:  # ComfyUI: an image model called without clip_fea attends its image
        return Context(text, text)            # branch to the text
    return Context(text, image_context(model, per_item(call.input(image_input), call.batch)))


def image_context(model, clip_fea: torch.Tensor) -> torch.Tensor:
    """CLIP image features -> image context, as ComfyUI's img_emb (FLF2V: positions added to the first tokens).

    diffusers' WanImageEmbedding instead reshapes [2B, 257] pairs into [B, 514]; ComfyUI gives [B, 514] directly.
    """
    embedder = model.condition_embedder.image_embedder
    if embedder.pos_embed is not None:
        clip_fea = clip_fea[:, :embedder.pos_embed.shape[1]]
        clip_fea = clip_fea + embedder.pos_embed[:, :clip_fea.shape[1]].to(clip_fea.dtype)
    return embedder.norm2(embedder.ff(embedder.norm1(clip_fea)))


def wan_sinusoid(dim: int, timestep: torch.Tensor) -> torch.Tensor:
    """Wan's own sinusoidal_embedding_1d, [cos, sin] of float32 angles, which ComfyUI uses (diffusers' Timesteps
    rounds its frequencies differently: up to 6e-5 apart at t = 1000)."""
    half = dim // 2
    position = timestep.float()
    angles = torch.outer(position, torch.pow(10000, -torch.arange(half, device=position.device).to(position)
                                             .div(half)))
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=1)


def time_embeddings(model, sigma: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """timestep [b] or [b, E] (E per-frame entries) -> (temb [b, E', dim], projection [b, E', 6, dim]), E' = E or 1."""
    if sigma.dim() not in (1, 2):
        raise ValueError(f"timestep has shape {list(sigma.shape)}; Wan takes [B] or per-frame [B, T]")
    sigma = sigma.reshape(sigma.shape[0], -1)
    condition = model.condition_embedder
    embedder_dtype = next(iter(condition.time_embedder.parameters())).dtype
    temb = condition.time_embedder(wan_sinusoid(model.config.freq_dim, sigma.flatten()).to(embedder_dtype)).to(dtype)
    projection = condition.time_proj(condition.act_fn(temb))
    batch, entries = sigma.shape
    return temb.view(batch, entries, -1), projection.view(batch, entries, 6, -1)


def token_entries(entries: int, total: int, lo: int, hi: int, device) -> Optional[torch.Tensor]:
    """Which per-frame timestep entry each token [lo, hi) takes, as ComfyUI's repeat_e spreads E entries over
    `total` tokens (E = latent frames: each frame's tokens share its entry); None for one shared entry."""
    if entries == 1:
        return None
    repeats = total // entries
    step = repeats if repeats * entries == total else repeats + 1
    return torch.arange(lo, hi, device=device) // step


def per_item(tensor: torch.Tensor, batch: int) -> torch.Tensor:
    """An input with one row per batch item; a batch-1 input serves every item."""
    return tensor.expand(batch, *tensor.shape[1:]) if tensor.shape[0] == 1 else tensor


PLAN = plan_for(())  # Wan without variant parts
