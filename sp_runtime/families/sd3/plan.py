"""SD3 / SD3.5 sequence-parallel plan: the image tokens split (each rank embeds only its own patches and
adds their rows of the learned positional table, cropped around its centre as ComfyUI and diffusers crop it), the
text replicated and joined in every joint block (text keys first); SD3.5 Medium's second attention spans the image
alone. No rotary: positions are in the embedding."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...sp import Output, Part, Plan, Stage, Stream, text_stream
from ...sp.tensor_parallel import GENERIC
from ...sp.tokens import TokenGrid, pad_to_patch, patchify


def check(call) -> None:
    config, x, inputs = call.config, call.x, call.inputs
    if inputs.get("control") is not None:
        raise ValueError("ControlNet inputs are not supported by the sequence-parallel SD3 / SD3.5")
    if x.dim() != 4 or x.shape[1] != config.in_channels:
        raise ValueError(f"x has shape {tuple(x.shape)}; SD3 takes [B, {config.in_channels}, H, W]")
    grid = TokenGrid.of(x.shape[-2], x.shape[-1], config.patch_size)
    if max(grid.rows, grid.cols) > config.pos_embed_max_size:
        raise ValueError(f"a {x.shape[-2]}x{x.shape[-1]} latent is {grid.rows}x{grid.cols} patches; this SD3 model's "
                         f"positional table covers at most {config.pos_embed_max_size} per side")
    context, y = inputs.get("context"), inputs.get("y")
    if context is None or context.dim() != 3 or context.shape[-1] != config.joint_attention_dim:
        raise ValueError(f"SD3 needs context [batch, text tokens, {config.joint_attention_dim}] (CLIP-L/G + T5); got "
                         f"{None if context is None else tuple(context.shape)}")
    if y is None or y.dim() != 2 or y.shape[-1] != config.pooled_projection_dim:
        raise ValueError(f"SD3 needs y [batch, {config.pooled_projection_dim}] (the pooled CLIP output); got "
                         f"{None if y is None else tuple(y.shape)}")


def layout(call) -> list[Stream]:
    """Patch tokens (features (c, ph, pw)) carry their row in the positional table as a last float32 feature
    (exact: the table has at most 2^24 rows), so each rank embeds just its shard."""
    x, config = call.input("x", torch.float32), call.config
    patch, side = config.patch_size, config.pos_embed_max_size
    grid = TokenGrid.of(x.shape[-2], x.shape[-1], patch)
    rows = torch.arange(grid.rows) + (side - grid.rows) // 2
    cols = torch.arange(grid.cols) + (side - grid.cols) // 2
    table_rows = (rows[:, None] * side + cols[None, :]).flatten().to(x.device, torch.float32)
    tokens = patchify(pad_to_patch(x, patch), patch)
    tokens = torch.cat([tokens, table_rows[None, :, None].expand(tokens.shape[0], -1, 1)], dim=-1)
    image = Part(tokens, None, _embed_image, Output(grid))
    return [Stream("image", [image]), text_stream(call.input("context"), None, "context_embedder")]


def _embed_image(model, raw: torch.Tensor) -> torch.Tensor:
    """PatchEmbed on patch tokens: its conv as a linear map, plus the tokens' rows of the positional table (added in
    float32, as diffusers does)."""
    proj = model.pos_embed.proj
    latent = F.linear(raw[..., :-1].to(proj.weight.dtype), proj.weight.flatten(1), proj.bias)
    positions = model.pos_embed.pos_embed[0, raw[..., -1].long()]
    return (latent + positions).to(latent.dtype)


def condition(call) -> None:
    """ComfyUI passes the timestep already scaled (sigma * 1000) and the pooled CLIP output as y."""
    call.temb = call.model.time_text_embed(call.sigma(), call.input("y").expand(call.batch, -1))


def joint_block(block, call) -> None:
    text, call.image = block(hidden_states=call.image, encoder_hidden_states=call.text, temb=call.temb)
    call.text = call.text if text is None else text  # the last block returns no text


def output_tokens(call, tokens: torch.Tensor) -> torch.Tensor:
    """diffusers' (ph, pw, c) output features -> (c, ph, pw)."""
    patch = call.config.patch_size
    return tokens.unflatten(-1, (patch, patch, call.config.out_channels)).permute(0, 1, 4, 2, 3).flatten(2)


PLAN = Plan(check=check, layout=layout, condition=condition, stages=(Stage("transformer_blocks", joint_block),),
            head=lambda call: call.model.proj_out(call.model.norm_out(call.image, call.temb)),
            output_tokens=output_tokens, tensor_parallel=GENERIC)
