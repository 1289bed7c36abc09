"""Ideogram 4's sequence-parallel plan (ComfyUI's Ideogram4Transformer2DModel call on diffusers'
Ideogram4Transformer2DModel).

Pool call: x [B, 128, H, W] (ComfyUI's Flux.2-format latent: 32 channels x 2 x 2 patch per latent pixel, one token
each), timestep sigma [B], context the text encoder's features [B, L, llm_features_dim] or None (the image alone,
DualModelGuider's text-free negative), attention_mask all ones or absent. Output: -velocity, like x.

PLAN: one split stream "packed" [text | image]: text rows embedded by llm_cond_norm / llm_cond_proj, image rows by
input_proj (features in ComfyUI's (pi, pj, c) order), each plus its role's embed_image_indicator row; positions
(i, i, i) for text token i and (0, row, col) + 65536 for the image; every block attends over the whole stream, its
AdaLN from the item's time embedding (t = 1 - sigma); the interleaved MRoPE (sp.tokens.PairFrequencies, float32
angles as both codes) on q / k reordered so that the split-half pairs are adjacent.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from ...sp import AttentionSpec, Output, Part, Plan, Stage, Stream
from ...sp.tokens import PairFrequencies, TokenGrid, split_half_order

IMAGE_POSITION_OFFSET = 65536
PATCH = 2  # ComfyUI's 2 x 2 patch inside each 128-channel latent pixel


def check(call) -> None:
    config, x, inputs = call.config, call.x, call.inputs
    if x.dim() != 4 or x.shape[1] != config.in_channels:
        raise ValueError(f"Ideogram 4 takes x [batch, {config.in_channels}, height, width] (the Flux.2 latent "
                         f"format); got {list(x.shape)}")
    context = inputs.get("context")
    if context is not None and (context.dim() != 3 or context.shape[0] not in (1, x.shape[0])
                                or context.shape[-1] != config.llm_features_dim):
        raise ValueError(f"Ideogram 4 needs context [batch, text tokens, {config.llm_features_dim}] or None; got "
                         f"{list(context.shape)}")
    mask = inputs.get("attention_mask")
    if mask is not None and not bool((mask != 0).all()):
        raise ValueError("Ideogram 4 attention_mask with padded text tokens (ComfyUI's segment mask) is not "
                         "supported under sequence parallelism yet")


def layout(call) -> list[Stream]:
    x = call.input("x")
    grid = TokenGrid.of(x.shape[2], x.shape[3], 1)
    channels = x.shape[1] // (PATCH * PATCH)
    tokens = x.unflatten(1, (channels, PATCH, PATCH)).permute(0, 4, 5, 2, 3, 1).flatten(3).flatten(1, 2)
    image_ids = torch.zeros(grid.count, 3)
    image_ids[:, 1] = torch.arange(grid.rows).repeat_interleave(grid.cols)
    image_ids[:, 2] = torch.arange(grid.cols).repeat(grid.rows)
    parts = [Part(tokens, image_ids + IMAGE_POSITION_OFFSET, _embed_image, Output(grid))]
    if call.inputs.get("context") is not None:
        context = call.input("context")
        text_ids = torch.arange(context.shape[1], dtype=torch.float32)[:, None].expand(-1, 3)
        parts.insert(0, Part(context, text_ids, _embed_text))
    return [Stream("packed", parts)]


def _embed_text(model, raw: torch.Tensor) -> torch.Tensor:
    return model.llm_cond_proj(model.llm_cond_norm(raw)) + model.embed_image_indicator.weight[0]


def _embed_image(model, raw: torch.Tensor) -> torch.Tensor:
    return model.input_proj(raw) + model.embed_image_indicator.weight[1]


def condition(call) -> None:
    """ComfyUI's t_embedding(1 - sigma) (sinusoids in float32, cast to the compute dtype), adaln_proj, SiLU."""
    model = call.model
    t_cond = model.t_embedding(1 - call.sigma()).to(call.dtype)
    call.adaln = torch.nn.functional.silu(model.adaln_proj(t_cond)).unsqueeze(1)


def run_block(block, call) -> None:
    call.packed = block(call.packed, None, None, call.adaln)


@lru_cache(maxsize=8)
def _pair_order(head_dim: int) -> torch.Tensor:
    return split_half_order(head_dim, head_dim)


def project_split_half(attn, hidden: torch.Tensor):
    """q, k, v [B, S, H, D] of diffusers' Ideogram4Attention, q and k normalised, their channels in rotary-pair
    order (pair i with i + D/2: the same reordering of q and k keeps every q . k)."""
    query, key, value = (proj(hidden).unflatten(-1, (attn.num_heads, -1)) for proj in (attn.to_q, attn.to_k,
                                                                                          attn.to_v))
    order = _pair_order(query.shape[-1]).to(query.device)
    return [attn.norm_q(query)[..., order], attn.norm_k(key)[..., order], value], None


def rope(config):
    return PairFrequencies.interleaved_mrope(config.attention_head_dim, config.rope_theta, config.mrope_section), None


def output_tokens(call, tokens: torch.Tensor) -> torch.Tensor:
    """(pi, pj, c) features -> ComfyUI's (c, pi, pj) channels, negated as ComfyUI returns."""
    channels = tokens.shape[-1] // (PATCH * PATCH)
    return -tokens.unflatten(-1, (PATCH, PATCH, channels)).permute(0, 1, 4, 2, 3).flatten(2)


PLAN = Plan(check=check, layout=layout, rope=rope, condition=condition,
            stages=(Stage("layers", run_block, attends="packed", text=None,
                          attention=AttentionSpec(project=project_split_half)),),
            head=lambda call: call.model.final_layer(call.packed, call.adaln), output="packed",
            output_tokens=output_tokens)
