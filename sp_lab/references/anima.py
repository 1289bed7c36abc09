"""Anima's single-device reference (tests): the LLM adapter written out from ComfyUI's facts as plain tensor maths
over the adapter's weights (independent of sp_runtime's module), then Cosmos-Predict2's reference (diffusers' stock
forward) on the context it gives."""
from __future__ import annotations

import math
from typing import Optional

import torch

from sp_lab.references import as_model
from sp_lab.references import cosmos

HEADS, EPS, THETA, PADDED = 16, 1e-6, 10000.0, 512


def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      t5xxl_ids: Optional[torch.Tensor] = None, t5xxl_weights: Optional[torch.Tensor] = None,
                      dtype: str = "default", **_ignored) -> torch.Tensor:
    """ComfyUI's Anima(x, timesteps, context, t5xxl_ids=..., t5xxl_weights=...): the adapter's output (x the token
    weights, zero-padded to 512 tokens) as the DiT's context; a call without ids takes context as it is; ComfyUI's
    packed prompts (what its host packs in extra_conds, sp_runtime's text.pack) are decoded and run one by one, as
    ComfyUI runs each conditioning."""
    from sp_runtime.families.anima import load_model
    from sp_runtime.families.anima.text import is_packed, unpack
    model = as_model(model_or_path, load_model, dtype)
    weights = {key[len("llm_adapter."):]: value for key, value in model.state_dict().items()
               if key.startswith("llm_adapter.")}
    with torch.no_grad():
        if is_packed(context):
            context = torch.cat([adapter_context(weights, *unpack(item)) for item in context])
        elif t5xxl_ids is not None:
            context = adapter_context(weights, context.to(weights["out_proj.weight"]), t5xxl_ids, t5xxl_weights)
    return cosmos.reference_forward(model, x, timestep, context)


def adapter_context(w: dict, text: torch.Tensor, ids: torch.Tensor, token_weights=None) -> torch.Tensor:
    batch = max(text.shape[0], ids.shape[0])
    text, ids = text.expand(batch, -1, -1), ids.expand(batch, -1).long()
    hidden = w["embed.weight"][ids]
    layer = 0
    while f"blocks.{layer}.norm_mlp.weight" in w:
        p = f"blocks.{layer}."
        if p + "self_attn.q_proj.weight" in w:
            normed = rms(hidden, w[p + "norm_self_attn.weight"])
            hidden = hidden + attention(w, p + "self_attn.", normed, normed)
        hidden = hidden + attention(w, p + "cross_attn.", rms(hidden, w[p + "norm_cross_attn.weight"]), text)
        inner = linear(rms(hidden, w[p + "norm_mlp.weight"]), w, p + "mlp.0")
        hidden = hidden + linear(0.5 * inner * (1 + torch.erf(inner / math.sqrt(2))), w, p + "mlp.2")
        layer += 1
    out = rms(linear(hidden, w, "out_proj"), w["norm.weight"])
    if token_weights is not None:
        out = out * token_weights.reshape(token_weights.shape[0], -1, 1).to(out)
    return torch.cat([out, out.new_zeros(batch, max(0, PADDED - out.shape[1]), out.shape[2])], dim=1)


def attention(w: dict, p: str, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """16 heads; q / k RMS-normed per head and rotated at positions 0.. of their own sequence."""
    def heads(tensor):
        return tensor.reshape(*tensor.shape[:2], HEADS, -1).transpose(1, 2)  # [B, H, L, D]
    q = rotary(rms(heads(queries @ w[p + "q_proj.weight"].T), w[p + "q_norm.weight"]))
    k = rotary(rms(heads(keys @ w[p + "k_proj.weight"].T), w[p + "k_norm.weight"]))
    v = heads(keys @ w[p + "v_proj.weight"].T)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    out = scores.softmax(dim=-1) @ v
    return out.transpose(1, 2).flatten(2) @ w[p + "o_proj.weight"].T


def rotary(tensor: torch.Tensor) -> torch.Tensor:
    """[B, H, L, D]: channel j < D/2 rotated with j + D/2 by position x theta^(-2j/D)."""
    half = tensor.shape[-1] // 2
    frequencies = THETA ** (-torch.arange(half, dtype=torch.float64) * 2 / tensor.shape[-1])
    angle = torch.arange(tensor.shape[2], dtype=torch.float64)[:, None] * frequencies
    cos, sin = angle.cos().to(tensor), angle.sin().to(tensor)
    first, second = tensor[..., :half], tensor[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def rms(tensor: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return tensor * torch.rsqrt(tensor.pow(2).mean(-1, keepdim=True) + EPS) * weight


def linear(tensor: torch.Tensor, w: dict, name: str) -> torch.Tensor:
    return tensor @ w[name + ".weight"].T + w[name + ".bias"]
