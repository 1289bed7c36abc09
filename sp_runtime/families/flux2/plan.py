"""Flux.2's sequence-parallel plan: Flux.1's (flux.PLAN), with these differences: unpatched latents, a fourth rotary
axis (the text position), references at index 10, 20, ..., shared modulations, and single blocks that take
[text, image] as one sequence with a fused attention + MLP projection."""
from __future__ import annotations

from dataclasses import replace

import torch

from ...sp import AttentionSpec, Stage
from ...sp.tensor_parallel import COLUMN, PACKED, ROW, Split, TensorParallelPlan
from ...sp.tokens import as_list, reference_placements
from .. import flux
from .detection import PATCH

REF_INDEX_SCALE = 10       # ComfyUI's ref_index_scale: reference i sits at index 10 * (i + 1)
REF_METHODS = ("index", "uxo")  # others ("offset") place references side by side at index 1
DEFAULT_REF_METHOD = "index"


def placements(method: str, x_hw, refs_hw) -> list[tuple[int, int, int]]:
    """ComfyUI's Flux.2 reference placement: "index" steps the index by 10 per reference."""
    found = reference_placements(method, tuple(x_hw), list(refs_hw), PATCH, REF_METHODS)
    return [(index * REF_INDEX_SCALE if method == "index" else index, row, col) for index, row, col in found]


def text_ids(length: int, device) -> torch.Tensor:
    """ComfyUI's Flux.2 text positions: 0 on the first three axes, the token index on the fourth."""
    ids = torch.zeros(length, 4, device=device)
    ids[:, 3] = torch.arange(length, device=device, dtype=torch.float32)
    return ids


def check(call) -> None:
    config, x, inputs = call.config, call.x, call.inputs
    if inputs.get("attention_mask") is not None:
        raise ValueError("attention_mask is not supported by the sequence-parallel Flux.2 (ComfyUI's Flux.2 text "
                         "encoders pass none; regional prompting masks would need the joint mask)")
    if inputs.get("control") is not None:
        raise ValueError("ControlNet inputs are not supported by the sequence-parallel Flux.2")
    if x.dim() != 4 or x.shape[1] != config.in_channels:
        raise ValueError(f"x has shape {tuple(x.shape)}; this Flux.2 takes [B, {config.in_channels}, H, W]")
    for number, ref in enumerate(as_list(inputs.get("ref_latents"))):
        if ref.dim() != 4 or ref.shape[1] != config.in_channels:
            raise ValueError(f"ref_latents[{number}] has shape {tuple(ref.shape)}; expected [B, "
                             f"{config.in_channels}, h, w]")
    context = inputs.get("context")
    if context is None or context.dim() != 3 or context.shape[-1] != config.joint_attention_dim:
        raise ValueError(f"Flux.2 needs context [batch, text tokens, {config.joint_attention_dim}] (the text "
                         f"encoder output)")


def condition(call) -> None:
    """Time (+ guidance, when the model has it and the call gives it) embedding and the shared modulations."""
    model, embed, guidance = call.model, call.model.time_guidance_embed, call.inputs.get("guidance")
    temb = embed.timestep_embedder(embed.time_proj(call.sigma() * 1000).to(call.dtype))
    if call.config.guidance_embeds and guidance is not None:  # klein has no guidance embedding
        guidance = flux.per_item(call.ctx.to_device("guidance", guidance.reshape(-1), call.dtype), call.batch)
        temb = temb + embed.guidance_embedder(embed.time_proj(guidance * 1000).to(call.dtype))
    call.temb = temb
    call.mod_img, call.mod_txt = model.double_stream_modulation_img(temb), model.double_stream_modulation_txt(temb)
    call.mod_single = model.single_stream_modulation(temb)


def double_block(block, call) -> None:
    call.text, call.image = block(hidden_states=call.image, encoder_hidden_states=call.text,
                                  temb_mod_img=call.mod_img, temb_mod_txt=call.mod_txt)


def single_block(block, call) -> None:
    call.image = block(hidden_states=call.image, encoder_hidden_states=None, temb_mod=call.mod_single)


def join_text(call) -> None:
    call.image = torch.cat([call.text, call.image], dim=1)


def project_fused(attn, hidden: torch.Tensor):
    fused = attn.to_qkv_mlp_proj(hidden)
    qkv, mlp = fused.split([3 * attn.inner_dim, fused.shape[-1] - 3 * attn.inner_dim], dim=-1)
    query, key, value = (part.unflatten(-1, (-1, attn.head_dim)) for part in qkv.chunk(3, dim=-1))
    return [attn.norm_q(query), attn.norm_k(key), value], mlp


def finish_fused(attn, attended: torch.Tensor, mlp: torch.Tensor) -> torch.Tensor:
    return attn.to_out(torch.cat([attended, attn.mlp_act_fn(mlp)], dim=-1))


PLAN = replace(
    flux.PLAN, check=check, condition=condition,
    layout=lambda call: flux.image_and_text(call, PATCH, placements, DEFAULT_REF_METHOD, text_ids, torch.float32),
    rope=lambda config: (config.axes_dims_rope, config.rope_theta),
    stages=(Stage("transformer_blocks", double_block),
            Stage("single_transformer_blocks", single_block, before=join_text,
                  attention=AttentionSpec(project_fused, finish_fused, text_prefix=True))),
    head=lambda call: call.model.proj_out(call.model.norm_out(call.image[:, call.text.shape[1]:], call.temb)),
    # fused single-block projections by the parts diffusers declares on them; SwiGLU feed-forward [gate, value]
    tensor_parallel=TensorParallelPlan(extra=(Split("to_qkv_mlp_proj", COLUMN, PACKED), Split("attn.to_out", ROW, PACKED),
                                              Split("linear_in", COLUMN, 2), Split("linear_out", ROW))))
