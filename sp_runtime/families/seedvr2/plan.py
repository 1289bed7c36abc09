"""SeedVR2's sequence-parallel plan.

Streams: the video's patch tokens (x and ComfyUI's `condition`, 16 + 17 channels, patch 1 x 2 x 2) split over the
ranks in frame-major order; the text (context, or the file's positive_conditioning when the call has none)
replicated. Every block attends within windows that change between blocks (odd blocks shifted by half a window):
a video token sees its window's video tokens and the text; a text token attends in every window and its output is
the mean over the windows (ComfyUI's NaSwinAttention).

Why keys and values are all-gathered (a custom block, the same under Ulysses, Ring and both): a window straddles
the ranks' token ranges and the shifted windows differ from the plain ones, so no split of whole windows serves both
block parities; and the text's output is a mean of one softmax per window, which no mask over one joint softmax
(sp_attention's SequenceMask under Ulysses / Ring) expresses. With every rank holding all keys / values, each rank
attends its own video queries window by window and computes the (short) text's outputs whole, exactly as one
device does; queries, MLPs and modulation stay split. At TP each rank holds its heads of the fused q / k / v (and
attends them window by window as above), the MLPs split Megatron's way (TENSOR_PARALLEL).
"""
from __future__ import annotations

import torch

from ...attention import gather_tokens
from ...attention.backends import attend
from ...sp import Plan, Stage, Stream, text_stream, video_part
from ...sp.tensor_parallel import COLUMN, ROW, Split, TensorParallelPlan
from ...sp.tokens import rotate
from .detection import LATENT_CHANNELS, PATCH, WINDOWS
from .windows import tables, text_angles, video_angles, windows_of

# each block's streams (`vid` / `txt`, or one shared `all`): the fused q / k / v in whole heads of each of its three
# parts, the attention output and the MLPs (SwiGLU or GELU) Megatron's way; the per-head q / k norms stay whole
TENSOR_PARALLEL = TensorParallelPlan(attentions=("attn",), extra=tuple(
    Split(f"{layer}.{stream}", kind, parts) for stream in ("vid", "txt", "all")
    for layer, kind, parts in (("proj_qkv", COLUMN, 3), ("attn.proj_out", ROW, 1))) + (
    Split("proj_in_gate", COLUMN), Split("proj_in", COLUMN), Split("proj_out", ROW)))


def check(call) -> None:
    x, condition = call.x, call.inputs.get("condition")
    if x.dim() != 5 or x.shape[1] != LATENT_CHANNELS:
        raise ValueError(f"x has shape {tuple(x.shape)}; SeedVR2 takes [B, {LATENT_CHANNELS}, T, H, W]")
    if x.shape[3] % PATCH[1] or x.shape[4] % PATCH[2]:
        raise ValueError(f"x has shape {tuple(x.shape)}: SeedVR2 needs an even latent height and width")
    if condition is None:
        raise ValueError("SeedVR2 needs condition (the SeedVR2Conditioning node's latent and mask)")
    channels = call.config.in_channels - LATENT_CHANNELS
    if condition.dim() != 5 or condition.shape[1] != channels or condition.shape[2:] != x.shape[2:] \
            or condition.shape[0] not in (1, x.shape[0]):
        raise ValueError(f"condition has shape {tuple(condition.shape)}; SeedVR2 takes [B, {channels}, T, H, W] "
                         f"matching x {tuple(x.shape)}")
    context = call.inputs.get("context")
    if context is not None and context.numel() and (context.dim() != 3 or context.shape[0] not in (1, x.shape[0])):
        raise ValueError(f"context has shape {tuple(context.shape)}; SeedVR2 takes [B, tokens, features]")


def layout(call) -> list[Stream]:
    x = call.input("x")
    condition = call.input("condition").expand(x.shape[0], *call.inputs["condition"].shape[1:])
    video = video_part(torch.cat([x, condition], dim=1), PATCH, _embed_video)
    context = call.inputs.get("context")
    if context is None or not context.numel():
        text = call.model.positive_conditioning[None].to(call.dtype)
    else:
        text = call.input("context")
    call.grid = (x.shape[2], x.shape[3] // PATCH[1], x.shape[4] // PATCH[2])
    return [Stream("video", [video]), text_stream(text, None, "txt_in")]


def _embed_video(model, raw: torch.Tensor) -> torch.Tensor:
    """Patch features (c, ph, pw) reordered to SeedVR2's (ph, pw, c), then vid_in."""
    patch = PATCH[1] * PATCH[2]
    return model.vid_in.proj(raw.unflatten(-1, (-1, patch)).transpose(-1, -2).flatten(-2))


def condition(call) -> None:
    """The time embedding, each parity's windows (this rank's members and rotary) and the text's rotary."""
    config, shard = call.config, call.shards["video"]
    call.emb = call.model.time(call.sigma().to(call.device), call.dtype)
    text_len = call.text.shape[1]
    local = torch.arange(shard.lo, shard.hi)
    call.windows = []
    for shifted in (False, True):
        windows = windows_of(call.grid, WINDOWS, shifted)
        angles = video_angles(windows, local, config.variant, config.rope_frequencies, text_len)
        owned = [((members >= shard.lo) & (members < shard.hi)).nonzero().flatten() for members in windows.members]
        call.windows.append((windows, [(members - shard.lo)[chosen].to(call.device)
                                       for members, chosen in zip(windows.members, owned)],
                             [members.to(call.device) for members in windows.members],
                             tables(angles, config.head_dim, call.device)))
    call.text_rope = (tables(text_angles(text_len, config.rope_frequencies), config.head_dim, call.device)
                      if config.variant == "3b" else None)


def run_block(block, call) -> None:
    index = call.block_index = getattr(call, "block_index", -1) + 1
    windows, own, members, rope = call.windows[index % 2]
    emb, eps = call.emb, block.eps
    vid_in = block.modulate("vid", _rms(call.video, eps), emb, "attn")
    txt_in = block.modulate("txt", _rms(call.text, eps), emb, "attn")
    vq, vk, vv = block.attn.qkv("vid", vid_in)
    tq, tk, tv = block.attn.qkv("txt", txt_in)
    vq, vk = rotate(vq, rope), rotate(vk, rope)
    if call.text_rope is not None:
        tq, tk = rotate(tq, call.text_rope), rotate(tk, call.text_rope)
    keys, values = (gather_tokens(t, call.shards["video"].shards, call.seq) for t in (vk, vv))
    vid_out, txt_out = windowed_attention(vq, tq, keys, values, tk, tv, own, members)
    attn = block.attn
    video = call.video + block.gate("vid", attn.proj_out.of("vid")(vid_out.flatten(2)), emb, "attn")
    call.video = block.feed_forward("vid", video, emb)
    if not block.last:
        text = call.text + block.gate("txt", attn.proj_out.of("txt")(txt_out.flatten(2)), emb, "attn")
        call.text = block.feed_forward("txt", text, emb)


def windowed_attention(vq, tq, keys, values, tk, tv, own, members):
    """This rank's video queries [B, n, H, D] window by window over that window's keys and the text's; the text's
    queries in every window, averaged. keys / values: the whole video's [B, S, H, D]."""
    heads = lambda t: t.transpose(1, 2)  # noqa: E731  [B, H, tokens, D]
    vid_out = torch.zeros_like(vq)
    txt_out = torch.zeros(tq.shape, dtype=torch.float32, device=tq.device)
    for mine, window in zip(own, members):
        key = heads(torch.cat([keys[:, window], tk], dim=1))
        value = heads(torch.cat([values[:, window], tv], dim=1))
        if mine.numel():
            vid_out[:, mine] = heads(attend(heads(vq[:, mine]), key, value))
        txt_out += heads(attend(heads(tq), key, value)).float()
    return vid_out, (txt_out / len(members)).to(tq.dtype)



def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=eps)


def before_blocks(call) -> None:
    call.block_index = -1


def head(call) -> torch.Tensor:
    return call.model.head(call.video, call.emb)


PLAN = Plan(check, layout, condition, [Stage("blocks", run_block, attends="video", text="text", attention=None,
                                             before=before_blocks)],
            head, output="video", tensor_parallel=TENSOR_PARALLEL)
