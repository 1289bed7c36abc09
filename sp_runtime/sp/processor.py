"""The one attention processor of every planned family: diffusers' attention modules project q, k, v as their
stage's AttentionSpec says, and attend through sp_attention with the geometry of the running stage, which the
executor makes current in a context variable (nothing travels through diffusers' rotary keyword arguments).
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..attention import SeqShards, sp_attention
from .plan import AttentionSpec
from .tokens import rotate

_CURRENT: ContextVar[Optional["Geometry"]] = ContextVar("sp_attention_geometry", default=None)


@dataclass
class Geometry:
    """What one stage's attention needs besides q, k, v: the split, this rank's rotary (cos, sin), the joined
    replicated text (its rotary, key mask, length) and a sequence mask."""

    seq: Any                                         # SeqParallel
    shards: SeqShards
    rope: Optional[tuple[torch.Tensor, torch.Tensor]]
    text_rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    text_mask: Optional[torch.Tensor] = None
    text_len: int = 0
    mask: Any = None                                 # attention.SequenceMask

    def attend(self, qkv, text_qkv=None, text_first: bool = True):
        """Rotate, attend over all split tokens and the text: (out [B, n, H, D], text out [B, L, H, D] or None)."""
        query, key, value = qkv
        if self.rope is not None:
            query, key = rotate(query, self.rope), rotate(key, self.rope)
        text = None
        if text_qkv is not None:
            text_q, text_k, text_v = text_qkv
            if self.text_rope is not None:
                text_q, text_k = rotate(text_q, self.text_rope), rotate(text_k, self.text_rope)
            text = (text_q, text_k, text_v)
        return sp_attention(query, key, value, self.seq, self.shards, text=text, text_mask=self.text_mask,
                            text_first=text_first, mask=self.mask)


@contextmanager
def current_geometry(geometry: Geometry):
    token = _CURRENT.set(geometry)
    try:
        yield
    finally:
        _CURRENT.reset(token)


class SPAttnProcessor:
    """Replaces a diffusers attention processor: projections per the spec, attention per the current Geometry.

    Rotary keyword arguments the blocks pass (image_rotary_emb, rotary_emb, freqs_cis) are named only so diffusers
    does not warn about them; they are not used.
    """

    def __init__(self, spec: AttentionSpec):
        self.spec = spec

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: Optional[torch.Tensor] = None,
                 attention_mask=None, image_rotary_emb=None, rotary_emb=None, freqs_cis=None,
                 encoder_hidden_states_mask=None, **_unused):
        geometry = _CURRENT.get()
        if geometry is None:
            raise RuntimeError("SPAttnProcessor runs inside the sequence-parallel executor only")
        qkv, extra = self.spec.project(attn, hidden_states)
        if encoder_hidden_states is not None and encoder_hidden_states is not hidden_states:  # joint attention
            # with the text passed apart (Lumina 2's blocks pass their own states as both: self-attention)
            out, text_out = geometry.attend(qkv, self.spec.project_text(attn, encoder_hidden_states),
                                            self.spec.text_first)
            dtype = qkv[2].dtype
            text_out = text_out.flatten(2, 3).to(dtype).contiguous()
            to_add_out = getattr(attn, "to_add_out", None)  # a last or single-stream block leaves the text as is
            if self.spec.finish_text is not None:
                text_out = self.spec.finish_text(attn, text_out)
            elif to_add_out is not None and not getattr(attn, "context_pre_only", False):
                text_out = to_add_out(text_out)
            return self.spec.finish(attn, out.flatten(2, 3).to(dtype).contiguous(), extra), text_out
        if self.spec.text_prefix:  # single-stream joint attention: [text, own tokens]
            length = geometry.text_len
            out, text_out = geometry.attend([t[:, length:] for t in qkv], [t[:, :length] for t in qkv])
            out = torch.cat([text_out, out], dim=1)
        else:
            out = geometry.attend(qkv)[0]
        return self.spec.finish(attn, out.flatten(2, 3).to(qkv[2].dtype).contiguous(), extra)
