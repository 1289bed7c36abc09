"""LTX-Video 0.9's sequence-parallel plan for ComfyUI's `diffusion_model(x, timestep, context, attention_mask,
frame_rate, keyframe_idxs)` (LTXVModel in comfy/ldm/lightricks/model.py) on diffusers' LTXVideoTransformer3DModel:
x [B, 128, F, H, W], one token per latent pixel; timestep the sigma [B] or, with a denoise mask (image to video),
per token [B, N, 1] (ComfyUI's LTXV.process_timestep); context the T5 output [B, L, 4096], replicated.

PLAN: one split "video" stream, each rank embedding, modulating (per-token sigmas sliced to its tokens) and writing
its own tokens; each block's self-attention through the executor, its cross-attention local against the projected
text (Stage.local). LTX rotates q / k over the whole width (across heads, before they are split) at ComfyUI's pixel
positions (latent corner x VAE factors (8, 32, 32), the first frame's causal fix where the file asks for it, time
x 1 / frame_rate, LTXVAddGuide's guides at keyframe_idxs): the projection rotates each rank's tokens with its own
rows of that table (ROTARY, set per call), so the executor's per-head tables are not used; at TP, its heads' columns
of it, the q / k norms' mean square summed over the TP group (TENSOR_PARALLEL).
"""
from __future__ import annotations

from contextvars import ContextVar
from typing import Optional

import torch

from ...sp import AttentionSpec, Plan, Stage, Stream, video_part
from ...sp.cross import Context
from ...sp.tensor_parallel import NORM, Split, TensorParallelPlan
from ...sp.video_tokens import VideoGrid
from ..ltx2.host import VAE_SCALE_FACTORS

UNIT = (1, 1, 1)
DEFAULT_FRAME_RATE = 25.0
ROTARY: ContextVar[Optional[tuple[torch.Tensor, torch.Tensor]]] = ContextVar("ltxv_rotary", default=None)


def check(call) -> None:
    config, x, inputs = call.config, call.x, call.inputs
    if x.dim() != 5 or x.shape[1] != config.in_channels:
        raise ValueError(f"x has shape {list(x.shape)}; this LTX-Video takes [B, {config.in_channels}, F, H, W]")
    context = inputs.get("context")
    if context is None or context.dim() != 3 or context.shape[-1] != config.caption_channels or \
            context.shape[0] not in (1, x.shape[0]):
        shape = None if context is None else list(context.shape)
        raise ValueError(f"LTX-Video needs context [B, L, {config.caption_channels}] (the T5 text encoder output); "
                         f"got {shape}")
    mask = inputs.get("attention_mask")
    if mask is not None and not bool((mask != 0).all()):
        raise ValueError("a text attention_mask with padding is not supported by the sequence-parallel LTX-Video "
                         "(ComfyUI's T5 for LTX-Video gives none); give the unpadded prompt")
    tokens = x.shape[2] * x.shape[3] * x.shape[4]
    if call.timestep.numel() not in (1, x.shape[0], x.shape[0] * tokens):
        raise ValueError(f"timestep has shape {list(call.timestep.shape)}; LTX-Video takes one sigma per item or "
                         f"one per video token ({tokens})")
    keyframes = inputs.get("keyframe_idxs")
    if keyframes is not None and (keyframes.dim() not in (3, 4) or keyframes.shape[1] != 3 or
                                  keyframes.shape[0] not in (1, x.shape[0]) or keyframes.shape[2] > tokens):
        raise ValueError(f"keyframe_idxs has shape {list(keyframes.shape)}; give the pixel positions of the last "
                         f"G <= {tokens} video tokens as [B, 3, G] (or [B, 3, G, 2] bounds)")


def layout(call) -> list[Stream]:
    x = call.input("x")
    call.grid = VideoGrid.of(tuple(x.shape[2:]), UNIT)
    return [Stream("video", [video_part(x, UNIT, "proj_in")])]


def condition(call) -> None:
    """This rank's sigmas -> adaLN (temb [B, 1 or n, 6 dim], embedded [B, 1 or n, dim]); the projected text on
    every rank; this rank's rows of the rotary table (ROTARY)."""
    model, config, batch, shard = call.model, call.config, call.batch, call.shards["video"]
    sigma = call.ctx.to_device("timestep", call.timestep, torch.float32).reshape(-1)
    sigma = sigma.expand(batch) if sigma.numel() == 1 else sigma.reshape(batch, -1)
    if sigma.dim() == 2 and sigma.shape[1] > 1:
        sigma = sigma[:, shard.lo:shard.hi]
    temb, embedded = model.time_embed((sigma * config.timestep_scale_multiplier).flatten(), batch_size=batch,
                                      hidden_dtype=call.dtype)
    call.temb, call.embedded = temb.view(batch, -1, temb.shape[-1]), embedded.view(batch, -1, embedded.shape[-1])
    context = call.input("context")
    call.text = Context(model.caption_projection(context.expand(batch, *context.shape[1:])))
    coords = pixel_coords(call, shard.lo, shard.hi)
    cos, sin = model.rope(call.video, video_coords=coords.expand(batch, -1, -1))
    ROTARY.set((cos.to(call.dtype), sin.to(call.dtype)))


def pixel_coords(call, lo: int, hi: int) -> torch.Tensor:
    """[B or 1, 3, hi - lo] positions of tokens lo..hi-1 as ComfyUI's LTXV computes them: latent corners x the VAE
    factors, the causal fix of the first frame, guide tokens at keyframe_idxs (their starts), time / frame rate."""
    grid, config = call.grid, call.config
    latent = call.grid.positions(lo, hi, call.device).T.float()
    coords = (latent * torch.tensor(VAE_SCALE_FACTORS, device=call.device, dtype=torch.float32)[:, None])[None]
    if config.causal_temporal_positioning:
        coords[:, 0] = (coords[:, 0] + 1 - VAE_SCALE_FACTORS[0]).clamp(min=0)
    keyframes = call.inputs.get("keyframe_idxs")
    if keyframes is not None:
        keyframes = call.ctx.to_device("keyframe_idxs", keyframes, torch.float32)
        keyframes = keyframes[..., 0] if keyframes.dim() == 4 else keyframes
        first = grid.count - keyframes.shape[2]
        coords = coords.expand(keyframes.shape[0], -1, -1).clone()
        start = max(lo, first)
        if start < hi:
            coords[:, :, start - lo:] = keyframes[:, :, start - first:hi - first]
    coords[:, 0] = coords[:, 0] * (1.0 / float(call.inputs.get("frame_rate") or DEFAULT_FRAME_RATE))
    return coords


def rotated(tensor: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[B, n, width] rotated by channel pairs (2i, 2i + 1), as ComfyUI's LTXV apply_rotary_emb."""
    even, odd = tensor.unflatten(-1, (-1, 2)).unbind(-1)
    return tensor * cos + torch.stack([-odd, even], dim=-1).flatten(-2) * sin


def project_rotated(attn, hidden: torch.Tensor):
    """q, k (normed across heads, then rotated over the whole width) and v, as [B, n, H, D]."""
    cos, sin = head_columns(attn, *ROTARY.get())
    query = rotated(attn.norm_q(attn.to_q(hidden)), cos, sin)
    key = rotated(attn.norm_k(attn.to_k(hidden)), cos, sin)
    return [tensor.unflatten(-1, (attn.heads, -1)) for tensor in (query, key, attn.to_v(hidden))], None


def head_columns(attn, *tables: torch.Tensor) -> list[torch.Tensor]:
    """Whole-width tables [.., width] cut to the columns of this TP rank's heads (attn.tp_heads; all without TP)."""
    lo, hi, heads = getattr(attn, "tp_heads", (0, attn.heads, attn.heads))
    width = tables[0].shape[-1] // heads
    return [table[..., lo * width:hi * width] for table in tables]


def run_block(block, call) -> None:
    call.video = block(call.video, call.text, call.temb)


def head(call) -> torch.Tensor:
    """The final modulated LayerNorm and proj_out: each token's latent channels."""
    model = call.model
    ROTARY.set(None)
    table = model.scale_shift_table[None, None].to(call.embedded) + call.embedded[:, :, None]
    shift, scale = table.unbind(dim=2)
    return model.proj_out(model.norm_out(call.video) * (1 + scale) + shift)


# the generic plan (attention, FeedForward) and the q / k norms across heads: split with q / k, their mean square
# summed over the TP group (as Wan's); each rank rotates its heads with its columns of the table (head_columns)
TENSOR_PARALLEL = TensorParallelPlan(extra=tuple(Split(f"{attn}.{name}", NORM) for attn in ("attn1", "attn2")
                                                 for name in ("norm_q", "norm_k")))

PLAN = Plan(check=check, layout=layout, condition=condition, head=head, output="video",
            stages=(Stage("transformer_blocks", run_block, attends="video", text=None, local=("attn2",),
                          attention=AttentionSpec(project=project_rotated)),),
            comfy_blocks={"double_block": "transformer_blocks"},
            tensor_parallel=TENSOR_PARALLEL)
