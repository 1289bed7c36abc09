"""Wan HuMo: ComfyUI's `audio_embed` [B, T, window, blocks, channels] projected to 16 audio tokens per latent frame
(`audio_proj`), and a frame-local audio cross-attention in every block (`audio_cross_attn_wrapper`, between the text
cross-attention and the FFN); `reference_latent` frames follow the video's as time_dim_concat's do (ComfyUI's
HumoWanModel), with zero audio.

diffusers has no HuMo, so the modules are stated here with ComfyUI's names (the checkpoint keys load as they are) and
the block runs through humo_block (diffusers' WanTransformerBlock order with the audio step added). Each video token
attends only to the 16 audio tokens of its own latent frame, so the audio tokens are replicated (they are few) and
every rank attends its tokens frame by frame: no communication.
"""
from __future__ import annotations

import torch
from torch import nn

from ...attention import local_attention
from ...sp.video_tokens import frame_runs
from ...checkpoints.loading import shape_of
from .variants import Variant, register

AUDIO_TOKENS = 16  # per latent frame, as ComfyUI's WanT2VCrossAttentionGather reshapes them
AUDIO, BLOCK_AUDIO = "audio_proj", "audio_cross_attn_wrapper"  # the same names in both layouts


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


def attach(model, entries: dict) -> None:
    """Give a WanTransformer3DModel (possibly on the meta device) HuMo's audio_proj and per-block audio attention."""
    device = model.patch_embedding.weight.device
    dim, heads, audio_dim = model.patch_embedding.out_channels, model.config.num_attention_heads, entries["audio_dim"]
    model.audio_proj = AudioProjection(entries["audio_in_features"], entries["audio_hidden"], audio_dim, device)
    for block in model.blocks:
        block.audio_cross_attn_wrapper = AudioCrossAttentionWrapper(dim, audio_dim, heads, model.config.eps, device)


def architecture(keys: dict, layout: str, config: dict) -> dict:
    hidden, in_features = shape_of(keys, f"{AUDIO}.audio_proj_glob_1.layer.weight")
    return {"audio_in_features": in_features, "audio_hidden": hidden,
            "audio_dim": shape_of(keys, f"{AUDIO}.audio_proj_glob_norm.layer.weight")[0]}


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


def check(call) -> None:
    if call.inputs.get("time_dim_concat") is not None:
        raise ValueError("time_dim_concat is not taken by a Wan humo model (as ComfyUI's HumoWanModel: its extra "
                         "frames come as reference_latent)")
    audio_embed, x = call.inputs.get("audio_embed"), call.x
    in_features = call.model.audio_proj.audio_proj_glob_1.layer.in_features
    if audio_embed is not None and (audio_embed.dim() != 5 or audio_embed.shape[1] != x.shape[2]
                                    or audio_embed[0, 0].numel() != in_features):
        raise ValueError(f"audio_embed has shape {list(audio_embed.shape)}; this Wan HuMo model takes [B, "
                         f"{x.shape[2]}, window, blocks, channels] (one entry per latent frame of x) with window x "
                         f"blocks x channels = {in_features}")


def prepare(call) -> None:
    """Every frame's audio tokens (zero audio for reference frames), or None without audio_embed."""
    call.humo_audio = None
    if call.inputs.get("audio_embed") is None:
        return
    audio_embed = call.input("audio_embed")
    grid = call.shards["video"].stream.parts[0].output.grid
    extra_frames = grid.frames - audio_embed.shape[1]
    if extra_frames:
        audio_embed = torch.cat([audio_embed, audio_embed.new_zeros(audio_embed.shape[0], extra_frames,
                                                                    *audio_embed.shape[2:])], dim=1)
    call.humo_audio = call.model.audio_proj(audio_embed).unflatten(1, (-1, AUDIO_TOKENS))


def humo_block(block, call) -> torch.Tensor:
    """diffusers' WanTransformerBlock.forward with HuMo's audio cross-attention after the text cross-attention."""
    if call.humo_audio is None:
        return block(call.video, call.context, call.block_modulation, None)
    hidden, modulation, table = call.video, call.block_modulation, block.scale_shift_table
    if modulation.dim() == 4:  # per-token modulation [b, n, 6, dim]
        parts = [part.squeeze(2) for part in (table.unsqueeze(0) + modulation.float()).chunk(6, dim=2)]
    else:
        parts = (table + modulation.float()).chunk(6, dim=1)
    shift, scale, gate, c_shift, c_scale, c_gate = parts
    normed = (block.norm1(hidden.float()) * (1 + scale) + shift).type_as(hidden)
    hidden = (hidden.float() + block.attn1(normed, None, None, None) * gate).type_as(hidden)
    hidden = hidden + block.attn2(block.norm2(hidden.float()).type_as(hidden), call.context, None, None)
    wrapper, shard = block.audio_cross_attn_wrapper, call.shards["video"]
    hidden = hidden + frame_local_attention(wrapper.audio_cross_attn, wrapper.norm1_audio(hidden), call.humo_audio,
                                            shard.lo, shard.stream.parts[0].output.grid.per_frame)
    normed = (block.norm3(hidden.float()) * (1 + c_scale) + c_shift).type_as(hidden)
    return (hidden.float() + block.ffn(normed).float() * c_gate).type_as(hidden)


HUMO = register(Variant(
    "humo", applies=lambda model, variant: getattr(model, AUDIO, None) is not None,
    anchor=f"{AUDIO}.audio_proj_glob_1.layer.weight", architecture=architecture,
    variant=lambda config: "humo" if config.get("audio_dim") else None, own_keys=(AUDIO + ".",),
    block_keys=(BLOCK_AUDIO + ".",), config_keys=("audio_in_features", "audio_hidden", "audio_dim"), attach=attach,
    info=lambda model: {"audio_in_features": model.audio_proj.audio_proj_glob_1.layer.in_features},
    comfy={"humo": "WAN21_HuMo"}, inputs={"humo": ("audio_embed",)}, appended="reference_latent", check=check,
    prepare=prepare, block=humo_block, tensor_parallel=True))
