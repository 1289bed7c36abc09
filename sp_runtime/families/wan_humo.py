"""Wan HuMo under Ulysses SP: ComfyUI's `audio_embed` [B, T, window, blocks, channels] projected to 16 audio tokens per
latent frame (`audio_proj`), and a frame-local audio cross-attention in every block (`audio_cross_attn_wrapper`,
between the text cross-attention and the FFN); `reference_latent` frames are appended to the video's as
time_dim_concat's are (ComfyUI's HumoWanModel), with zero audio.

diffusers has no HuMo, so the modules are stated here with ComfyUI's names (the checkpoint keys load as they are) and
the block runs through humo_block (diffusers' WanTransformerBlock order with the audio step added). Each video token
attends only to the 16 audio tokens of its own latent frame, so under SP the audio tokens are replicated (they are
few) and every rank attends its tokens frame by frame: no communication.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..attention import local_attention
from ..sp.video_tokens import frame_runs

AUDIO_TOKENS = 16  # per latent frame, as ComfyUI's WanT2VCrossAttentionGather reshapes them


class _Layer(nn.Module):
    """ComfyUI's DummyAdapterLayer: one more `.layer` level in the key names."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


class AudioProjection(nn.Module):
    """audio_embed [B, T, window, blocks, channels] -> audio tokens [B, T * 16, audio_dim] (frame-major)."""

    def __init__(self, in_features: int, hidden: int, audio_dim: int, device=None):
        super().__init__()
        self.audio_proj_glob_1 = _Layer(nn.Linear(in_features, hidden, device=device))
        self.audio_proj_glob_2 = _Layer(nn.Linear(hidden, hidden, device=device))
        self.audio_proj_glob_3 = _Layer(nn.Linear(hidden, AUDIO_TOKENS * audio_dim, device=device))
        self.audio_proj_glob_norm = _Layer(nn.LayerNorm(audio_dim, device=device))

    def forward(self, audio_embed: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.audio_proj_glob_1(audio_embed.flatten(2)))
        hidden = torch.relu(self.audio_proj_glob_2(hidden))
        tokens = self.audio_proj_glob_3(hidden).unflatten(-1, (AUDIO_TOKENS, -1))
        return self.audio_proj_glob_norm(tokens).flatten(1, 2)


class AudioAttention(nn.Module):
    """ComfyUI's WanT2VCrossAttentionGather weights: q from the video, k / v from the audio, q / k RMS norms."""

    def __init__(self, dim: int, audio_dim: int, heads: int, eps: float, device=None):
        super().__init__()
        self.heads = heads
        self.q, self.o = nn.Linear(dim, dim, device=device), nn.Linear(dim, dim, device=device)
        self.k, self.v = nn.Linear(audio_dim, dim, device=device), nn.Linear(audio_dim, dim, device=device)
        self.norm_q = nn.RMSNorm(dim, eps=eps, device=device)
        self.norm_k = nn.RMSNorm(dim, eps=eps, device=device)


class AudioCrossAttentionWrapper(nn.Module):
    def __init__(self, dim: int, audio_dim: int, heads: int, eps: float, device=None):
        super().__init__()
        self.audio_cross_attn = AudioAttention(dim, audio_dim, heads, eps, device)
        self.norm1_audio = nn.LayerNorm(dim, eps, device=device)


def attach_humo_modules(model, audio_in_features: int, audio_hidden: int, audio_dim: int) -> None:
    """Give a WanTransformer3DModel (possibly on the meta device) HuMo's audio_proj and per-block audio attention."""
    device = model.patch_embedding.weight.device
    dim, heads = model.patch_embedding.out_channels, model.config.num_attention_heads
    model.audio_proj = AudioProjection(audio_in_features, audio_hidden, audio_dim, device)
    for block in model.blocks:
        block.audio_cross_attn_wrapper = AudioCrossAttentionWrapper(dim, audio_dim, heads, model.config.eps, device)


@dataclass
class HumoAudio:
    """The audio tokens of every frame (replicated) and which frame each of this rank's tokens lies in."""

    tokens: torch.Tensor        # [b, frames * 16, audio_dim]
    first: int                  # this rank's first token
    per_frame: int              # tokens per latent frame

    def attend(self, wrapper: AudioCrossAttentionWrapper, hidden: torch.Tensor) -> torch.Tensor:
        """The audio cross-attention output of this rank's tokens, each against its own frame's audio tokens."""
        return frame_local_attention(wrapper.audio_cross_attn, wrapper.norm1_audio(hidden),
                                     self.tokens.unflatten(1, (-1, AUDIO_TOKENS)), self.first, self.per_frame)


def frame_local_attention(attention: AudioAttention, hidden: torch.Tensor, audio: torch.Tensor, first: int,
                          per_frame: int) -> torch.Tensor:
    """Tokens first.. (hidden [b, n, dim]), each attending only to the audio tokens of its own frame (audio
    [b, frames, k, audio_dim]), frame f being tokens [f * per_frame, (f + 1) * per_frame): HuMo's and S2V's
    audio attention on one rank's share, which may start or end inside a frame."""
    query = attention.norm_q(attention.q(hidden)).unflatten(2, (attention.heads, -1))
    key = attention.norm_k(attention.k(audio)).unflatten(3, (attention.heads, -1))
    value = attention.v(audio).unflatten(3, (attention.heads, -1))
    parts = [local_attention(query[:, start:stop], key[:, frame], value[:, frame])
             for frame, start, stop in frame_runs(first, hidden.shape[1], per_frame)]
    out = torch.cat(parts, dim=1) if parts else query
    return attention.o(out.flatten(2, 3).type_as(hidden))


def prepare_audio(model, inputs: dict, x: torch.Tensor, grid, lo: int, ctx, dtype: torch.dtype
                  ) -> Optional[HumoAudio]:
    """HuMo's audio tokens for this call (zero audio for reference frames), or None without audio_embed."""
    audio_embed = inputs.get("audio_embed")
    if audio_embed is None:
        return None
    in_features = model.audio_proj.audio_proj_glob_1.layer.in_features
    if audio_embed.dim() != 5 or audio_embed.shape[1] != x.shape[2] or audio_embed[0, 0].numel() != in_features:
        raise ValueError(f"audio_embed has shape {list(audio_embed.shape)}; this Wan HuMo model takes [B, "
                         f"{x.shape[2]}, window, blocks, channels] (one entry per latent frame of x) with window x "
                         f"blocks x channels = {in_features}")
    audio_embed = ctx.to_device("audio_embed", audio_embed, dtype)
    extra_frames = grid.frames - audio_embed.shape[1]
    if extra_frames:
        audio_embed = torch.cat([audio_embed, audio_embed.new_zeros(audio_embed.shape[0], extra_frames,
                                                                    *audio_embed.shape[2:])], dim=1)
    return HumoAudio(model.audio_proj(audio_embed), lo, grid.per_frame)


def humo_block(block, hidden: torch.Tensor, context, modulation: torch.Tensor, attention, audio: HumoAudio
               ) -> torch.Tensor:
    """diffusers' WanTransformerBlock.forward with HuMo's audio cross-attention after the text cross-attention."""
    table = block.scale_shift_table
    if modulation.dim() == 4:  # per-token modulation [b, n, 6, dim]
        parts = [part.squeeze(2) for part in (table.unsqueeze(0) + modulation.float()).chunk(6, dim=2)]
    else:
        parts = (table + modulation.float()).chunk(6, dim=1)
    shift, scale, gate, c_shift, c_scale, c_gate = parts
    normed = (block.norm1(hidden.float()) * (1 + scale) + shift).type_as(hidden)
    hidden = (hidden.float() + block.attn1(normed, None, None, attention) * gate).type_as(hidden)
    hidden = hidden + block.attn2(block.norm2(hidden.float()).type_as(hidden), context, None, None)
    hidden = hidden + audio.attend(block.audio_cross_attn_wrapper, hidden)
    normed = (block.norm3(hidden.float()) * (1 + c_scale) + c_shift).type_as(hidden)
    return (hidden.float() + block.ffn(normed).float() * c_gate).type_as(hidden)


# ---------------------------------------------------------------------------------------------------------------
# Single-device reference (wan.reference_forward): diffusers' stock forward, with the audio step hooked in

@contextmanager
def audio_reference_hooks(model, audio_embed: torch.Tensor, frames: int):
    """While open, diffusers' stock blocks add HuMo's audio attention to their text cross-attention output (which
    equals adding it after the cross-attention residual), computed over the whole sequence in ComfyUI's way (tokens
    regrouped per frame; frames beyond the audio's get zero audio). Written apart from HumoAudio."""
    padded = torch.zeros(audio_embed.shape[0], frames, *audio_embed.shape[2:], dtype=audio_embed.dtype,
                         device=audio_embed.device)
    padded[:, :audio_embed.shape[1]] = audio_embed
    with torch.no_grad():
        tokens = model.audio_proj(padded)
    handles = []
    for block in model.blocks:
        seen = {}
        handles.append(block.norm2.register_forward_pre_hook(lambda module, args, seen=seen: seen.update(x=args[0])))
        handles.append(block.attn2.register_forward_hook(
            lambda module, args, out, block=block, seen=seen: out + _whole_sequence_audio(
                block.audio_cross_attn_wrapper, seen["x"] + out, tokens, frames)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _whole_sequence_audio(wrapper, hidden: torch.Tensor, tokens: torch.Tensor, frames: int) -> torch.Tensor:
    attention = wrapper.audio_cross_attn
    batch, length, dim = hidden.shape
    heads = attention.heads
    query = attention.norm_q(attention.q(wrapper.norm1_audio(hidden)))
    key, value = attention.norm_k(attention.k(tokens)), attention.v(tokens)
    query = query.reshape(batch * frames, length // frames, heads, -1).transpose(1, 2)
    key = key.reshape(batch * frames, AUDIO_TOKENS, heads, -1).transpose(1, 2)
    value = value.reshape(batch * frames, AUDIO_TOKENS, heads, -1).transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value)
    return attention.o(out.transpose(1, 2).reshape(batch, length, dim))
