"""Krea 2's sequence-parallel plan for ComfyUI's `diffusion_model(x, timesteps, context)` (SingleStreamDiT in
comfy/ldm/krea2/model.py) on diffusers' Krea2Transformer2DModel: x [B, 16, H, W], padded by
wrap-around to 2 x 2 patches; timesteps the sigma (embedded x 1000); context the Qwen3-VL layer stack
[B, L, layers x width], replicated.

PLAN: the image patch tokens split (positions (0, row, column)); the text fused (text_fusion, txt_in) on every rank
and joined as the leading tokens of every single-stream block (text_prefix: each rank runs the block on [text, its
image tokens], the attention over all of them); grouped key / value heads repeated for their query heads, the
attention output gated by sigmoid(to_gate) per token (at TP: each rank's query heads and their gate, the key / value
heads split or kept whole: sp.tensor_parallel.KEY_VALUE). Reference latents (the style-reference workflow: ComfyUI uses
them only with a ref_latents_method) join the split stream at (i, row, column), reference i counted from 1; with
"index_timestep_zero" their tokens are modulated by the time embedding of 0 (a per-token modulation).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...sp import AttentionSpec, Plan, Stage, Stream, image_parts, text_stream
from ...sp.tensor_parallel import COLUMN, KEY_VALUE, ROW, Split, TensorParallelPlan, grouped_key_values
from ...sp.tokens import as_list
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
    for number, ref in enumerate(as_list(inputs.get("ref_latents"))):
        if ref.dim() != 4 or ref.shape[1] != channels or ref.shape[0] not in (1, x.shape[0]):
            raise ValueError(f"ref_latents[{number}] has shape {list(ref.shape)}; Krea 2 takes [B or 1, {channels}, "
                             f"h, w] references")
    if call.timestep.numel() not in (1, x.shape[0]):
        raise ValueError(f"timestep has shape {list(call.timestep.shape)}; Krea 2 takes one per batch item")


def layout(call) -> list[Stream]:
    x, method = call.input("x"), call.inputs.get("ref_latents_method")
    refs = as_list(call.inputs.get("ref_latents")) if method is not None else []  # ComfyUI: no method, no refs
    refs = [call.ctx.to_device(f"ref_latents.{number}", ref, call.dtype) for number, ref in enumerate(refs)]
    call.zero_refs = method == "index_timestep_zero" and bool(refs)
    image = image_parts([x, *refs], [(index, 0, 0) for index in range(len(refs) + 1)], PATCH, False, torch.float32,
                        3, "img_in")
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
    """The time embedding and the blocks' modulation; with index_timestep_zero, per token: this rank's reference
    tokens take the modulation of time 0 (text and image tokens the sigma's)."""
    model = call.model
    sigma = call.sigma()
    call.temb = model.time_embed(sigma, dtype=call.dtype)
    call.temb_mod = model.time_mod_proj(F.gelu(call.temb, approximate="tanh"))
    if call.zero_refs:
        zero = model.time_mod_proj(F.gelu(model.time_embed(sigma * 0, dtype=call.dtype), approximate="tanh"))
        references = call.shards["image"].flags(lambda part: part.output is None, call.device)
        tokens = torch.cat([torch.zeros(call.text_len, dtype=torch.bool, device=call.device), references])
        call.temb_mod = torch.where(tokens[None, :, None], zero, call.temb_mod)


def join_text(call) -> None:
    call.image = torch.cat([call.text, call.image], dim=1)


def run_block(block, call) -> None:
    call.image = block(call.image, call.temb_mod, None)


def project_gated(attn, hidden: torch.Tensor):
    """q, k, v [B, S, heads, D] (key / value heads repeated for their groups) and the output gate's logits."""
    query = attn.norm_q(attn.to_q(hidden).unflatten(-1, (attn.num_heads, attn.head_dim)))
    key, value = (proj(hidden).unflatten(-1, (-1, attn.head_dim)) for proj in (attn.to_k, attn.to_v))
    key, value = grouped_key_values(attn, [attn.norm_k(key), value], attn.num_heads, attn.num_kv_heads)
    return [query, key, value], attn.to_gate(hidden)


def finish_gated(attn, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return attn.to_out[0](out * torch.sigmoid(gate))


def head(call) -> torch.Tensor:
    return call.model.final_layer(call.image[:, call.text_len:], call.temb)


# the single-stream blocks (the text fusion runs whole on every rank): query heads split, their gate with them, key /
# value heads split where the degree divides both counts, else kept whole; the SwiGLU Megatron's way
TENSOR_PARALLEL = TensorParallelPlan(extra=(Split("attn.to_gate", COLUMN), Split("attn.to_k", KEY_VALUE),
                                            Split("attn.to_v", KEY_VALUE), Split("ff.gate", COLUMN),
                                            Split("ff.up", COLUMN), Split("ff.down", ROW)))

PLAN = Plan(check=check, layout=layout, condition=condition, head=head, rope=rope, output="image",
            comfy_blocks={"single_block": "transformer_blocks"},
            stages=(Stage("transformer_blocks", run_block, before=join_text,
                          attention=AttentionSpec(project_gated, finish_gated, text_prefix=True)),),
            tensor_parallel=TENSOR_PARALLEL)
