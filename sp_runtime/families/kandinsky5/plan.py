"""Kandinsky 5's sequence-parallel plan for ComfyUI's `diffusion_model(x, timestep, context, y, time_dim_replace)`
(comfy/ldm/kandinsky5/model.py) on diffusers' Kandinsky5Transformer3DModel: x [B, C, H, W] (image model) or
[B, C, T, H, W] (video model: latent, image latent and mask channels), padded by wrap-around to (1, 2, 2) patches;
timestep as it comes (sigma x 1000); context the Qwen2.5-VL text [B, L, 3584] and y the pooled CLIP text [B, 768],
replicated; time_dim_replace (image to video) the image latent written over the first channels and frames of x.

PLAN: one split "video" stream (patch features ordered (pt, ph, pw, c), positions (frame, row, column) scaled as
ComfyUI's rope_encode_3d); the text blocks run on every rank over the whole text (it is short) before the visual
blocks; each visual block's self-attention through the executor, its cross-attention local to each rank against the
replicated text. Attention outside the executor (text self-attention, cross-attention) is LocalAttention: diffusers'
processor without the bfloat16 rounding of q and k it applies after the rotary (ComfyUI rounds nothing).
"""
from __future__ import annotations

import torch

from ...attention import local_attention
from ...sp import AttentionSpec, Output, Part, Plan, Stage, Stream
from ...sp.tensor_parallel import COLUMN, GATHER, ROW, Split, TensorParallelPlan
from ...sp.tokens import TokenGrid
from ...sp.video_tokens import VideoGrid, pad_to_patch_3d
from .detection import PATCH

ROPE_THETA = 10000.0
PRO_WIDTH, PRO_AREA, PRO_SCALE = 4096, 14080, (1.0, 3.16, 3.16)  # ComfyUI: the Pro model at large latents


def _heads(attn, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.unflatten(-1, (attn.num_heads, -1))


def rotated(tensor: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """[B, L, H, D] rotated by diffusers' Kandinsky 5 rotation matrices [.., D/2, 2, 2] (pairs 2i, 2i + 1)."""
    pairs = tensor.reshape(*tensor.shape[:-1], -1, 1, 2)
    return (rope * pairs).sum(dim=-1).reshape(tensor.shape).type_as(tensor)


class LocalAttention:
    """A Kandinsky 5 attention module on this rank's tokens against whole, replicated keys: the text blocks' self-
    attention (with the 1-D rotary) and the visual blocks' cross-attention."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, rotary_emb=None, **_unused):
        source = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        query = attn.query_norm(_heads(attn, attn.to_query(hidden_states)))
        key = attn.key_norm(_heads(attn, attn.to_key(source)))
        if rotary_emb is not None:
            query, key = rotated(query, rotary_emb), rotated(key, rotary_emb)
        out = local_attention(query, key, _heads(attn, attn.to_value(source)))
        return attn.out_layer(out.flatten(2, 3).type_as(query))


LOCAL = LocalAttention()


def project(attn, hidden: torch.Tensor):
    query = attn.query_norm(_heads(attn, attn.to_query(hidden)))
    key = attn.key_norm(_heads(attn, attn.to_key(hidden)))
    return [query, key, _heads(attn, attn.to_value(hidden))], None


def finish(attn, out: torch.Tensor, extra) -> torch.Tensor:
    return attn.out_layer(out)


def check(call) -> None:
    config, x, inputs = call.config, call.x, call.inputs
    channels = 2 * config.in_visual_dim + 1 if config.visual_cond else config.in_visual_dim
    if x.dim() not in (4, 5) or x.shape[1] != channels:
        raise ValueError(f"x has shape {list(x.shape)}; this Kandinsky 5 takes {channels} latent channels")
    for name, width, rank in (("context", config.in_text_dim, 3), ("y", config.in_text_dim2, 2)):
        given = inputs.get(name)
        if given is None or given.dim() != rank or given.shape[-1] != width or given.shape[0] not in (1, x.shape[0]):
            shape = None if given is None else list(given.shape)
            raise ValueError(f"Kandinsky 5 needs {name} [B, {'L, ' if rank == 3 else ''}{width}] (the "
                             f"{'Qwen2.5-VL text' if rank == 3 else 'pooled CLIP text'}); got {shape}")
    if call.timestep.numel() not in (1, x.shape[0]):
        raise ValueError(f"timestep has shape {list(call.timestep.shape)}; Kandinsky 5 takes one per batch item")
    replace = inputs.get("time_dim_replace")
    if replace is not None and (replace.dim() != 5 or x.dim() != 5 or replace.shape[1] > x.shape[1] or
                                any(a > b for a, b in zip(replace.shape[2:], x.shape[2:]))):
        raise ValueError(f"time_dim_replace has shape {list(replace.shape)}; give the image latent [B, C, T', H, W] "
                         f"of at most x's channels and frames ({list(x.shape)})")


def layout(call) -> list[Stream]:
    """x (first frames replaced by time_dim_replace), padded to whole patches, as one part at ComfyUI's positions."""
    x = call.input("x")
    video = x if x.dim() == 5 else x.unsqueeze(2)
    padded = pad_to_patch_3d(video, PATCH)
    replace = call.inputs.get("time_dim_replace")
    if replace is not None:
        replace = pad_to_patch_3d(call.input("time_dim_replace"), PATCH)
        padded = padded.clone()
        padded[:, :replace.shape[1], :replace.shape[2]] = replace.expand(padded.shape[0], *replace.shape[1:])
    call.grid = grid = VideoGrid.of(tuple(padded.shape[2:]), PATCH)
    output = Output(grid, None) if x.dim() == 5 else Output(TokenGrid.of(x.shape[2], x.shape[3], PATCH[1]), 0)
    ids = positions(call.config, grid, tuple(video.shape[2:]), x.device)
    return [Stream("video", [Part(grid.patches(padded, 0, grid.count), ids, _embed, output)])]


def positions(config, grid: VideoGrid, size: tuple[int, int, int], device) -> torch.Tensor:
    """[N, 3] (frame, row, column) positions as ComfyUI's rope_encode_3d: each axis 0 .. (n - 1) / scale in n steps."""
    scale = config.rope_scale_factor
    if config.model_dim == PRO_WIDTH and size[1] * size[2] >= PRO_AREA:
        scale = PRO_SCALE
    axes = [torch.linspace(0, (count - 1) / factor, count, device=device, dtype=torch.float64)
            for count, factor in zip((grid.frames, grid.rows, grid.cols), scale)]
    index = grid.positions(0, grid.count, device)
    return torch.stack([axis[index[:, number]] for number, axis in enumerate(axes)], dim=1)


def _embed(model, patches: torch.Tensor) -> torch.Tensor:
    """Patch features (c, pt, ph, pw) -> ComfyUI's (pt, ph, pw, c), then the visual embedding."""
    grouped = patches.unflatten(-1, (-1, PATCH[0] * PATCH[1] * PATCH[2])).transpose(-1, -2).flatten(-2)
    return model.visual_embeddings.in_layer(grouped)


def rope(config):
    return tuple(config.axes_dims), ROPE_THETA


def condition(call) -> None:
    """The time embedding (+ the pooled text); the text through the text blocks on every rank."""
    model, batch = call.model, call.batch
    for block in model.visual_transformer_blocks:
        block.cross_attention.set_processor(LOCAL)
    for block in model.text_transformer_blocks:
        block.self_attention.set_processor(LOCAL)
    timestep = call.ctx.to_device("timestep", call.timestep.reshape(-1), torch.float32).expand(batch)
    pooled = call.input("y")
    call.time_embed = model.time_embeddings(timestep).to(call.dtype) + \
        model.pooled_text_embeddings(pooled.expand(batch, -1))
    context = call.input("context")
    text = model.text_embeddings(context.expand(batch, *context.shape[1:]))
    text_rope = model.text_rope_embeddings(torch.arange(text.shape[1], device=call.device)).unsqueeze(0)
    for block in model.text_transformer_blocks:
        text = block(text, call.time_embed, text_rope)
    call.text = text


def run_block(block, call) -> None:
    call.video = block(call.video, call.text, call.time_embed, None, None)


def head(call) -> torch.Tensor:
    """The out layer on this rank's tokens: features (c, pt, ph, pw)."""
    out_layer = call.model.out_layer
    shift, scale = torch.chunk(out_layer.modulation(call.time_embed).unsqueeze(dim=1), 2, dim=-1)
    states = (out_layer.norm(call.video.float()) * (scale.float() + 1.0) + shift.float()).type_as(call.video)
    return out_layer.out_layer(states)


def output_tokens(call, tokens: torch.Tensor) -> torch.Tensor:
    """Video outputs in VideoGrid.write's feature order (pt, ph, pw, c); images stay (c, ph, pw) (TokenGrid's)."""
    if call.x.dim() == 4:
        return tokens
    return tokens.unflatten(-1, (-1, PATCH[0] * PATCH[1] * PATCH[2])).transpose(-1, -2).flatten(-2)


# the visual blocks' own names (the text blocks run whole on every rank): self- and cross-attention split by heads
# (their per-head q / k norms stay whole), the GELU feed-forward Megatron's way, the 9-way modulation gathered
TENSOR_PARALLEL = TensorParallelPlan(extra=(
    *(Split(name, COLUMN) for name in ("to_query", "to_key", "to_value", "feed_forward.in_layer")),
    *(Split(name, ROW) for name in ("self_attention.out_layer", "cross_attention.out_layer", "feed_forward.out_layer")),
    Split("visual_modulation.out_layer", GATHER)))

PLAN = Plan(check=check, layout=layout, condition=condition, head=head, rope=rope, output="video",
            output_tokens=output_tokens, comfy_blocks={"double_block": "visual_transformer_blocks"},
            stages=(Stage("visual_transformer_blocks", run_block, attends="video", text=None,
                          attention=AttentionSpec(project=project, finish=finish)),),
            tensor_parallel=TENSOR_PARALLEL)
