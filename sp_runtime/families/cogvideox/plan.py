"""CogVideoX's sequence-parallel plan: the video tokens split in balanced shards (each rank patch-embeds its own
share, padded by wrap-around to whole 2 x 2 x 2 patches as ComfyUI pads, at its (frame, row, column) rotary); the
projected text replicated and leading the joint sequence of every block, projected and output through the same
to_q / to_k / to_v / to_out as the video (one attention over [text, video], rotary on the video only)."""
from __future__ import annotations

import torch

from ...sp import AttentionSpec, Plan, Stage, Stream, project_out, project_qkv, text_stream, video_part
from ..hunyuan_video.plan import per_item, unpatch_order
from .detection import ROPE_THETA


def patch_of(config) -> tuple[int, int, int]:
    return config.patch_size_t, config.patch_size, config.patch_size


def check(call) -> None:
    config, x, context = call.config, call.x, call.inputs.get("context")
    if x.dim() != 5 or x.shape[1] != config.in_channels:
        raise ValueError(f"x has shape {list(x.shape)}; this CogVideoX takes [B, {config.in_channels}, T, H, W] "
                         f"(the latent with its concatenated condition)")
    if context is None or context.dim() != 3 or context.shape[-1] != config.text_embed_dim:
        shape = None if context is None else list(context.shape)
        raise ValueError(f"CogVideoX needs context [B, L, {config.text_embed_dim}] (the T5 tokens); got {shape}")


def layout(call) -> list[Stream]:
    video = video_part(call.input("x"), patch_of(call.config), embed_patches)
    text = per_item(call.input("context"), call.batch)
    return [Stream("image", [video]), text_stream(text, None, embed_text)]


def embed_patches(model, patches: torch.Tensor) -> torch.Tensor:
    """patch_embed.proj (a Linear over (c, pt, ph, pw) features) on this rank's patches."""
    return model.patch_embed.proj(patches)


def embed_text(model, text: torch.Tensor) -> torch.Tensor:
    return model.patch_embed.text_proj(text)


def condition(call) -> None:
    """temb = the timestep's embedding (+ the ofs embedding where the model has one and the call gives ofs, as
    ComfyUI adds it)."""
    model, dtype = call.model, call.dtype
    call.temb = model.time_embedding(model.time_proj(call.sigma()).to(dtype))
    ofs = call.inputs.get("ofs")
    if model.ofs_embedding is not None and ofs is not None:
        values = per_item(call.ctx.to_device("ofs", ofs.reshape(-1), torch.float32), call.batch)
        call.temb = call.temb + model.ofs_embedding(model.ofs_proj(values).to(dtype))


def block(module, call) -> None:
    call.image, call.text = module(call.image, call.text, call.temb)


def head(call) -> torch.Tensor:
    """norm_final (per token: the text ComfyUI normalises with it is dropped), the output AdaLayerNorm, proj_out."""
    model = call.model
    return model.proj_out(model.norm_out(model.norm_final(call.image), temb=call.temb))


def rope(config):
    """The (frame, row, column) rotary axes of CogVideoX 1.5 (ComfyUI's "slice" grid: integer positions)."""
    head_dim = config.attention_head_dim
    return (head_dim // 4, head_dim // 8 * 3, head_dim // 8 * 3), ROPE_THETA


# text and video share the attention's projections, the text first in the joint sequence
JOINT = AttentionSpec(project_text=lambda attn, text: project_qkv(attn, text)[0],
                      finish_text=lambda attn, out: project_out(attn, out, None))
PLAN = Plan(check=check, layout=layout, condition=condition, rope=rope,
            stages=(Stage("transformer_blocks", block, attention=JOINT),), head=head, output_tokens=unpatch_order)
