"""Krea 2's sequence-parallel plan for ComfyUI's `diffusion_model(x, timesteps, context)` (SingleStreamDiT in
comfy/ldm/krea2/model.py) on diffusers' Krea2Transformer2DModel: x [B, 16, H, W], padded by wrap-around to 2 x 2 patches; timesteps the sigma (embedded x 1000); context the Qwen3-VL
layer stack [B, L, layers x width], replicated.

PLAN: the image patch tokens split (positions (0, row, column)); the text fused (text_fusion, txt_in) on every rank
and joined as the leading tokens of every single-stream block (text_prefix: each rank runs the block on [text, its
image tokens], the attention over all of them); grouped key / value heads repeated for their query heads, the
attention output gated by sigmoid(to_gate) per token. Reference latents (ComfyUI's style reference, with their
zero-timestep modulation) are refused by name: not served yet.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...sp import AttentionSpec, Plan, Stage, Stream, image_parts, text_stream
from .detection import PATCH


def check(call) -> None:
    config, x, inputs = call.config, call.x, call.inputs
    channels = config.in_channels // (PATCH * PATCH)
    if x.dim() != 4 or x.shape[1] != channels:
        raise ValueError(f"x has shape {list(x.shape)}; Krea 2 takes [B, {channels}, H, W] latents")
    context = inputs.get("context")
    width = config.num_text_layers * config.text_hidden_dim
    if context is None or context.dim() != 3 or context.shape[-1] != width or context.shape[0] not in (1, x.shape[0]):
        shape = None if context is None else list(context.shape)
        raise ValueError(f"Krea 2 needs context [B, L, {width}] ({config.num_text_layers} Qwen3-VL layers of "
                         f"{config.text_hidden_dim}: CLIPLoader type 'krea2'); got {shape}")
    if inputs.get("ref_latents"):
        raise ValueError("ref_latents (Krea 2's image style reference) are not supported by the sequence-parallel "
                         "Krea 2 yet; use the text-to-image workflow")
    if call.timestep.numel() not in (1, x.shape[0]):
        raise ValueError(f"timestep has shape {list(call.timestep.shape)}; Krea 2 takes one per batch item")


def layout(call) -> list[Stream]:
    x = call.input("x")
    image = image_parts([x], [(0, 0, 0)], PATCH, False, torch.float32, 3, "img_in")
    context = call.input("context")
    call.text_len = context.shape[1]
    text = text_stream(context.expand(call.batch, *context.shape[1:]),
                       torch.zeros(context.shape[1], 3, device=context.device), _fused_text)
    return [Stream("image", image), text]


def _fused_text(model, context: torch.Tensor) -> torch.Tensor:
    """The Qwen3-VL layer stack -> text tokens: text_fusion (its own attention, unsplit), then txt_in."""
    config = model.config
    stack = context.unflatten(-1, (config.num_text_layers, config.text_hidden_dim))
    return model.txt_in(model.text_fusion(stack))


def rope(config):
    return tuple(config.axes_dims_rope), config.rope_theta


def condition(call) -> None:
    model = call.model
    sigma = call.sigma()
    call.temb = model.time_embed(sigma, dtype=call.dtype)
    call.temb_mod = model.time_mod_proj(F.gelu(call.temb, approximate="tanh"))


def join_text(call) -> None:
    call.image = torch.cat([call.text, call.image], dim=1)


def run_block(block, call) -> None:
    call.image = block(call.image, call.temb_mod, None)


def project_gated(attn, hidden: torch.Tensor):
    """q, k, v [B, S, heads, D] (key / value heads repeated for their groups) and the output gate's logits."""
    query = attn.norm_q(attn.to_q(hidden).unflatten(-1, (attn.num_heads, attn.head_dim)))
    key, value = (proj(hidden).unflatten(-1, (attn.num_kv_heads, attn.head_dim)) for proj in (attn.to_k, attn.to_v))
    key = attn.norm_k(key)
    repeats = attn.num_heads // attn.num_kv_heads
    return [query, key.repeat_interleave(repeats, dim=2), value.repeat_interleave(repeats, dim=2)], attn.to_gate(hidden)


def finish_gated(attn, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return attn.to_out[0](out * torch.sigmoid(gate))


def head(call) -> torch.Tensor:
    return call.model.final_layer(call.image[:, call.text_len:], call.temb)


PLAN = Plan(check=check, layout=layout, condition=condition, head=head, rope=rope, output="image",
            comfy_blocks={"single_block": "transformer_blocks"},
            stages=(Stage("transformer_blocks", run_block, before=join_text,
                          attention=AttentionSpec(project_gated, finish_gated, text_prefix=True)),))
