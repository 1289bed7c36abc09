"""Cosmos-Predict2's sequence-parallel plan for ComfyUI's `diffusion_model(x, timesteps, context, fps,
padding_mask)` (MiniTrainDIT in comfy/ldm/cosmos/predict2.py) on diffusers' CosmosTransformer3DModel: x
[B, C, T, H, W] with the zero padding-mask channel appended, timesteps [B] embedded as they come (ComfyUI's
FLOW_COSMOS scaling happens before the model), context [B, L, 1024] replicated.

PLAN: one split "video" stream of (frame, row, column) patches; each block's self-attention through the executor,
its cross-attention local to each rank against the whole replicated text (Stage.local). Cosmos rotates q / k by halves (rotate_half) with one theta per axis (NTK-scaled rows and columns);
the executor's tables pair neighbouring channels, so q and k are permuted to that pairing after their norms: the
same permutation on both leaves every dot product as it was.
"""
from __future__ import annotations

import torch

from ...sp import AttentionSpec, Plan, Stage, Stream, video_part
from ...sp.cross import Context

ROPE_THETA = 10000.0


def rope(config):
    """(frame, row, column) rotary sizes and diffusers' CosmosRotaryPosEmbed thetas (NTK factors of rope_scale)."""
    head_dim = config.attention_head_dim
    spatial = head_dim // 6 * 2
    axes = (head_dim - 2 * spatial, spatial, spatial)
    thetas = tuple(ROPE_THETA * scale ** (size / (size - 2)) for scale, size in zip(config.rope_scale, axes))
    return axes, thetas


def halves_to_pairs(tensor: torch.Tensor) -> torch.Tensor:
    """[..., D] with channels i and i + D/2 rotated together -> channels 2i, 2i + 1."""
    return torch.stack(tensor.chunk(2, dim=-1), dim=-1).flatten(-2)


def project_qkv(attn, hidden: torch.Tensor):
    """q, k, v [B, S, H, D]: per-head RMS norms on q / k, which are then put in the executor's rotary pairing."""
    query, key, value = (proj(hidden).unflatten(-1, (attn.heads, -1)) for proj in (attn.to_q, attn.to_k, attn.to_v))
    return [halves_to_pairs(attn.norm_q(query)), halves_to_pairs(attn.norm_k(key)), value], None


def check(call) -> None:
    check_latent(call)
    check_context(call.inputs.get("context"), call)
    for name in ("t5xxl_ids", "t5xxl_weights"):
        if call.inputs.get(name) is not None:
            raise ValueError(f"{name} is not supported by the sequence-parallel Cosmos-Predict2")


def check_latent(call) -> None:
    """x [B, C, T, H, W], one timestep per batch item, no padding_mask."""
    config, x = call.config, call.x
    if x.dim() != 5 or x.shape[1] != config.in_channels:
        raise ValueError(f"x has shape {list(x.shape)}; this Cosmos-Predict2 takes [B, {config.in_channels}, T, H, W]")
    if call.timestep.numel() not in (1, x.shape[0]):
        raise ValueError(f"timestep has shape {list(call.timestep.shape)}; the sequence-parallel Cosmos-Predict2 "
                         f"takes one timestep per batch item (per-frame timesteps of a denoise mask are not "
                         f"supported)")
    if call.inputs.get("padding_mask") is not None:
        raise ValueError("padding_mask is not supported by the sequence-parallel Cosmos-Predict2")


def check_context(context, call, width: int = 0, what: str = "Cosmos-Predict2 needs context",
                  source: str = "the T5 text encoder output") -> None:
    """context [B or 1, L, width] (default: the DiT's text width)."""
    width = width or call.config.text_embed_dim
    if context is None or context.dim() != 3 or context.shape[-1] != width or \
            context.shape[0] not in (1, call.x.shape[0]):
        shape = None if context is None else list(context.shape)
        raise ValueError(f"{what} [B, L, {width}] ({source}); got {shape}")


def layout(call) -> list[Stream]:
    """x with its all-zero padding-mask channel, patched as (c, pt, ph, pw) features (ComfyUI's PatchEmbed)."""
    x = call.input("x")
    latent = torch.cat([x, x.new_zeros(x.shape[0], 1, *x.shape[2:])], dim=1)
    return [Stream("video", [video_part(latent, tuple(call.config.patch_size), _embed)])]


def _embed(model, patches: torch.Tensor) -> torch.Tensor:
    return model.patch_embed.proj(patches)


def condition(call) -> None:
    """The text replicated on every rank, and the time embedding (embed_time)."""
    context = call.input("context")
    call.text = Context(context.expand(call.batch, *context.shape[1:]))
    embed_time(call)


def embed_time(call) -> None:
    """ComfyUI's t_embedder (sinusoids [cos, sin] of the timestep, float32) -> the adaLN-LoRA term temb [B, 3 dim]
    and the RMS-normed sinusoids [B, dim]."""
    model = call.model
    timestep = call.ctx.to_device("timestep", call.timestep.reshape(-1), torch.float32).expand(call.batch)
    sinusoids = model.time_embed.time_proj(timestep).to(call.dtype)
    call.temb, call.embedded = model.time_embed.t_embedder(sinusoids), model.time_embed.norm(sinusoids)


def run_block(block, call) -> None:
    call.video = block(call.video, call.text, call.embedded, call.temb)


def head(call) -> torch.Tensor:
    """norm_out + proj_out: [b, n, (ph, pw, pt, c)] tokens, which with pt = 1 is VideoGrid's (pt, ph, pw, c)."""
    return call.model.proj_out(call.model.norm_out(call.video, call.embedded, call.temb))


PLAN = Plan(check=check, layout=layout, condition=condition,
            stages=(Stage("transformer_blocks", run_block, attends="video", text=None, local=("attn2",),
                          attention=AttentionSpec(project=project_qkv)),),
            head=head, rope=rope, output="video", comfy_blocks={"double_block": "transformer_blocks"})
