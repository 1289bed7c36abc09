"""Local cross-attention of a stage: each rank's own tokens attend to a replicated context (text, and an image
context through the module's added projections), with no communication. The stage passes a Context as the
blocks' encoder_hidden_states; Stage.local names the attention modules this processor serves."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..attention import local_attention


@dataclass
class Context:
    """The replicated context of a local cross-attention: embedded text [B, L, dim], image tokens or None."""

    text: torch.Tensor
    image: Optional[torch.Tensor] = None


def _heads(attn, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.unflatten(2, (attn.heads, -1))


def _normed(attn, norm, tensor: torch.Tensor) -> torch.Tensor:
    """[B, L, H, D]: a q / k norm over all heads (Wan's), or over each head's D (weight of size D, e.g. Cosmos')."""
    weight = getattr(norm, "weight", None)
    if weight is not None and weight.shape[0] == tensor.shape[-1]:
        return norm(tensor)
    return _heads(attn, norm(tensor.flatten(2)))


class LocalCrossAttention:
    """q from this rank's tokens, k / v from the context (to_k / to_v, norm_k; the image through add_k_proj /
    add_v_proj, norm_added_k, its output added); to_out applied."""

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: Context = None, attention_mask=None,
                 rotary_emb=None, **_unused) -> torch.Tensor:
        context = encoder_hidden_states
        if not isinstance(context, Context):
            raise TypeError("LocalCrossAttention takes an sp.cross.Context as encoder_hidden_states")
        query = _normed(attn, attn.norm_q, _heads(attn, attn.to_q(hidden_states)))
        key = _normed(attn, attn.norm_k, _heads(attn, attn.to_k(context.text)))
        out = local_attention(query, key, _heads(attn, attn.to_v(context.text))).flatten(2, 3).type_as(query)
        if getattr(attn, "add_k_proj", None) is not None and context.image is not None:
            key = _normed(attn, attn.norm_added_k, _heads(attn, attn.add_k_proj(context.image)))
            value = _heads(attn, attn.add_v_proj(context.image))
            out = out + local_attention(query, key, value).flatten(2, 3).type_as(query)
        for module in attn.to_out:
            out = module(out)
        return out
