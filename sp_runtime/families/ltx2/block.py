"""LTX-2's audio-video block, the plan's custom block (sp.Stage(attention=None)): ComfyUI's
BasicAVTransformerBlock.forward with LTX-2.3 / 2.5's attention gates and prompt AdaLN, on this rank's video tokens
and all audio tokens, with diffusers' modules.

Video self-attention goes through sp_attention over the video shards; text cross-attention, audio self-attention and
audio-to-video attention (video queries, audio keys) are local; video-to-audio attention (audio queries over the
split video keys) merges the ranks' partial results by log-sum-exp (attention_over_key_shards), so the audio stays
the same on every rank. At TP every attention holds its heads (the rotary tables cut to them: head_rope) and
the q / k norms across heads sum their mean square over the TP group (plan.TENSOR_PARALLEL). Unlike diffusers'
block, the video-to-audio attention reads the video normalised after the audio-to-video residual (ComfyUI's order).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ...attention import SeqShards, attention_over_key_shards, sp_attention


@dataclass
class Conditioning:
    """One modality's conditioning on this rank (its states are the executor's, call.video / call.audio)."""

    temb: torch.Tensor           # [B, 1 or n, 6 dim] block modulation
    embedded: torch.Tensor       # [B, 1 or n, dim] output modulation
    cross_scale_shift: torch.Tensor
    cross_gate: torch.Tensor
    rope: tuple                  # self-attention rotary (cos, sin) of these tokens
    cross_rope: tuple            # audio <-> video attention rotary of these tokens
    text: torch.Tensor           # [B, L', dim] projected prompt
    prompt_temb: Optional[torch.Tensor] = None  # [B, 1, 2 dim] prompt AdaLN (LTX-2.3); None: its static table
    mask: Any = None             # the self-attention's sequence mask (the video's guides.GuideMask) or None


def conditioning(model, prefix: str, batch: int, timestep, gate_timestep, rope, cross_rope, text,
                 cross_modules: tuple[str, str], dtype) -> Conditioning:
    """Modulations of one modality: its own timestep for the block, the output and the cross-modal scale / shift;
    `gate_timestep` (the other stream's largest, ComfyUI's choice) for the gate of the attention into it."""

    def embed(module, values):
        result, embedded = module(values.flatten(), batch_size=batch, hidden_dtype=dtype)
        return result.view(batch, -1, result.shape[-1]), embedded.view(batch, -1, embedded.shape[-1])

    temb, embedded = embed(getattr(model, f"{prefix}time_embed"), timestep)
    scale_shift, _ = embed(getattr(model, cross_modules[0]), timestep)
    gate, _ = embed(getattr(model, cross_modules[1]), gate_timestep)
    return Conditioning(temb, embedded, scale_shift, gate, rope, cross_rope, text)


def _modulation(table: torch.Tensor, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    values = table[None, None].to(temb.device) + temb.reshape(temb.shape[0], temb.shape[1], table.shape[0], -1)
    return values.unbind(dim=2)


def _rotate(attn, tensor: torch.Tensor, rope) -> torch.Tensor:
    from diffusers.models.transformers.transformer_ltx2 import apply_interleaved_rotary_emb, apply_split_rotary_emb
    rotate = apply_interleaved_rotary_emb if attn.rope_type == "interleaved" else apply_split_rotary_emb
    return rotate(tensor, rope)


def head_rope(attn, rope):
    """A rotary (cos, sin) of all heads cut to this TP rank's heads (attn.tp_heads; whole without TP): the split
    layout's [B, H, n, r] along its heads, the interleaved [B, n, width] along its columns."""
    if rope is None or not hasattr(attn, "tp_heads"):
        return rope
    lo, hi, heads = attn.tp_heads
    if rope[0].dim() == 4:
        return tuple(table[:, lo:hi] for table in rope)
    width = rope[0].shape[-1] // heads
    return tuple(table[..., lo * width:hi * width] for table in rope)


def _heads(attn, query_in, key_in, query_rope, key_rope) -> tuple[torch.Tensor, ...]:
    """q, k, v [B, n, H, D] of an LTX2Attention (q/k RMS-normed across heads, then rotated)."""
    query = attn.norm_q(attn.to_q(query_in))
    key = attn.norm_k(attn.to_k(key_in))
    value = attn.to_v(key_in)
    if query_rope is not None:
        query_rope, key_rope = head_rope(attn, query_rope), head_rope(attn, key_rope)
        query, key = _rotate(attn, query, query_rope), _rotate(attn, key, key_rope)
    return tuple(tensor.unflatten(2, (attn.heads, -1)) for tensor in (query, key, value))


def _out(attn, attended: torch.Tensor, like: torch.Tensor, query_in: torch.Tensor) -> torch.Tensor:
    """The output projection of attended [B, n, H, D], after LTX-2.3's per-head gates (2 sigmoid of logits from
    the query input: each token's own, so exact on any shard)."""
    attended = attended.to(like.dtype)
    if attn.to_gate_logits is not None:
        attended = attended * (2.0 * torch.sigmoid(attn.to_gate_logits(query_in))).unsqueeze(-1)
    return attn.to_out[0](attended.flatten(2, 3))


def _text_attention(block, prefix: str, hidden: torch.Tensor, cond: Conditioning, query_mod: tuple) -> torch.Tensor:
    """The prompt cross-attention of one modality; LTX-2.3 / 2.5 modulate its query (shift, scale, gate of the
    block's rows 6-8) and the prompt (the block's prompt table plus the prompt AdaLN, or the table alone)."""
    normed = getattr(block, f"{prefix}norm2")(hidden)
    text = cond.text
    if query_mod:
        shift, scale, _ = query_mod
        normed = normed * (1 + scale) + shift
        table = getattr(block, f"{prefix}prompt_scale_shift_table")
        shift_kv, scale_kv = (_modulation(table, cond.prompt_temb) if cond.prompt_temb is not None
                              else table[None, None].to(text.dtype).unbind(dim=2))
        text = text * (1 + scale_kv) + shift_kv
    out = getattr(block, f"{prefix}attn2")(normed, encoder_hidden_states=text)
    return out * query_mod[2] if query_mod else out


def audio_video_block(block, v: torch.Tensor, a: torch.Tensor, video: Conditioning, audio: Conditioning, seq,
                      shards: SeqShards) -> tuple[torch.Tensor, torch.Tensor]:
    """One block on this rank's video states v and all audio states a (module docstring)."""
    v_mods = _modulation(block.scale_shift_table, video.temb)
    a_mods = _modulation(block.audio_scale_shift_table, audio.temb)
    v_shift, v_scale, v_gate, v_shift_mlp, v_scale_mlp, v_gate_mlp = v_mods[:6]
    a_shift, a_scale, a_gate, a_shift_mlp, a_scale_mlp, a_gate_mlp = a_mods[:6]
    normed = block.norm1(v) * (1 + v_scale) + v_shift
    query, key, value = _heads(block.attn1, normed, normed, video.rope, video.rope)
    attended, _ = sp_attention(query, key, value, seq, shards, mask=video.mask)
    v = v + _out(block.attn1, attended, v, normed) * v_gate

    normed = block.audio_norm1(a) * (1 + a_scale) + a_shift
    a = a + block.audio_attn1(normed, query_rotary_emb=head_rope(block.audio_attn1, audio.rope)) * a_gate
    v = v + _text_attention(block, "", v, video, v_mods[6:])
    a = a + _text_attention(block, "audio_", a, audio, a_mods[6:])

    a_normed = block.video_to_audio_norm(a)
    v_a2v_scale, v_a2v_shift, v_v2a_scale, v_v2a_shift = _modulation(
        block.video_a2v_cross_attn_scale_shift_table[:4], video.cross_scale_shift)
    a_a2v_scale, a_a2v_shift, a_v2a_scale, a_v2a_shift = _modulation(
        block.audio_a2v_cross_attn_scale_shift_table[:4], audio.cross_scale_shift)
    a2v_gate = _modulation(block.video_a2v_cross_attn_scale_shift_table[4:], video.cross_gate)[0]
    v2a_gate = _modulation(block.audio_a2v_cross_attn_scale_shift_table[4:], audio.cross_gate)[0]

    a2v = block.audio_to_video_attn(block.audio_to_video_norm(v) * (1 + v_a2v_scale) + v_a2v_shift,
                                    encoder_hidden_states=a_normed * (1 + a_a2v_scale) + a_a2v_shift,
                                    query_rotary_emb=head_rope(block.audio_to_video_attn, video.cross_rope),
                                    key_rotary_emb=head_rope(block.audio_to_video_attn, audio.cross_rope))
    v = v + a2v * a2v_gate
    v2a_query = a_normed * (1 + a_v2a_scale) + a_v2a_shift
    query, key, value = _heads(block.video_to_audio_attn, v2a_query,
                               block.audio_to_video_norm(v) * (1 + v_v2a_scale) + v_v2a_shift, audio.cross_rope,
                               video.cross_rope)
    v2a = _out(block.video_to_audio_attn, attention_over_key_shards(query, key, value, seq), a, v2a_query)
    a = a + v2a * v2a_gate

    v = v + block.ff(block.norm3(v) * (1 + v_scale_mlp) + v_shift_mlp) * v_gate_mlp
    a = a + block.audio_ff(block.audio_norm3(a) * (1 + a_scale_mlp) + a_shift_mlp) * a_gate_mlp
    return v, a


def output_head(model, hidden: torch.Tensor, cond: Conditioning, prefix: str) -> torch.Tensor:
    """The output AdaLN and projection of one modality."""
    table = getattr(model, f"{prefix}scale_shift_table")
    values = table[None, None] + cond.embedded[:, :, None]
    shift, scale = values[:, :, 0], values[:, :, 1]
    hidden = getattr(model, f"{prefix}norm_out")(hidden) * (1 + scale) + shift
    return getattr(model, f"{prefix}proj_out")(hidden)
