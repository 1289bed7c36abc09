"""ERNIE-Image's sequence-parallel plan for ComfyUI's `diffusion_model(x, timesteps, context)` (ErnieImageModel in
comfy/ldm/ernie/model.py) on diffusers' ErnieImageTransformer2DModel: x [B, 128, H, W] (the Flux.2 latent, patch 1),
timesteps sigma x 1000, context the Ministral 3 features [B, L, text_in_dim] (ComfyUI's model reads no mask).

PLAN: one split stream [image | text] (image tokens at (L, row, column), text token i at (i, 0, 0)); every block
attends over the whole stream, its AdaLN shared by all blocks and all tokens of an item. ERNIE's rotary is not a
rotation of channel pairs (channel i and i + D/2 take angles of different frequencies, as diffusers' and ComfyUI's
split-half form computes it), so the plan rotates q / k itself with this rank's angles (float64 as ComfyUI's) and
declares no executor rotary. The blocks are diffusers' (sequence-first: called on transposed views).
"""
from __future__ import annotations

from contextvars import ContextVar

import torch

from ...sp import AttentionSpec, Output, Part, Plan, Stage, Stream
from ...sp.tensor_parallel import COLUMN, ROW, Split, TensorParallelPlan
from ...sp.tokens import TokenGrid, grid_ids, patchify

_ROTARY: ContextVar = ContextVar("ernie_image_rotary", default=None)  # this rank's (cos, sin) while a block runs


def check(call) -> None:
    config, x, inputs = call.config, call.x, call.inputs
    patch = config.patch_size
    if x.dim() != 4 or x.shape[1] != config.in_channels or x.shape[2] % patch or x.shape[3] % patch:
        raise ValueError(f"x has shape {list(x.shape)}; ERNIE-Image takes [B, {config.in_channels}, H, W] latents "
                         f"(H and W multiples of its patch {patch})")
    context = inputs.get("context")
    if context is None or context.dim() != 3 or context.shape[0] not in (1, x.shape[0]) \
            or context.shape[-1] != config.text_in_dim:
        shape = None if context is None else list(context.shape)
        raise ValueError(f"ERNIE-Image needs context [B, L, {config.text_in_dim}] (its Ministral 3 text encoder); "
                         f"got {shape}")
    if call.timestep.numel() not in (1, x.shape[0]):
        raise ValueError(f"timestep has shape {list(call.timestep.shape)}; ERNIE-Image takes one per batch item")


def layout(call) -> list[Stream]:
    x, context = call.input("x"), call.input("context")
    length = context.shape[1]
    grid = TokenGrid.of(x.shape[2], x.shape[3], call.config.patch_size)
    image_ids = grid_ids(grid, float(length), 0, 0, False, torch.float32, x.device)
    text_ids = torch.zeros(length, 3, device=x.device)
    text_ids[:, 0] = torch.arange(length, device=x.device)
    call.ids = torch.cat([image_ids, text_ids])
    return [Stream("packed", [Part(patchify(x, grid.patch), image_ids, _embed_image, Output(grid)),
                              Part(context.expand(call.batch, -1, -1), text_ids, _embed_text)])]


def _embed_image(model, raw: torch.Tensor) -> torch.Tensor:
    """Patch tokens [B, n, C*p*p] (features (c, ph, pw)) through the patch convolution, one patch at a time."""
    conv = model.x_embedder.proj
    patch = conv.kernel_size[0]
    patches = raw.reshape(-1, conv.in_channels, patch, patch)
    return conv(patches).reshape(raw.shape[0], raw.shape[1], conv.out_channels)


def _embed_text(model, raw: torch.Tensor) -> torch.Tensor:
    return raw if model.text_proj is None else model.text_proj(raw)


def condition(call) -> None:
    """The time embedding c, the blocks' shared modulation ([1, B, width] each: the blocks run sequence-first) and
    this rank's rotary angles."""
    model = call.model
    call.c = model.time_embedding(model.time_proj(call.sigma()).to(call.dtype))
    call.temb = [chunk.unsqueeze(0) for chunk in model.adaLN_modulation(call.c).chunk(6, dim=-1)]
    shard = call.shards["packed"]
    call.rotary = rotary_tables(call.ids[shard.lo:shard.hi].to(call.device), call.config)


def rotary_tables(ids: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [1, n, 1, head_dim] of ERNIE's per-channel angles: per axis positions x theta^(-2i/dim), float64,
    the axes concatenated and every angle repeated for two channels (diffusers' freqs_cis layout)."""
    angles = []
    for axis, dim in enumerate(config.rope_axes_dim):
        omega = 1.0 / config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=ids.device) / dim)
        angles.append(ids[:, axis].to(torch.float64)[:, None] * omega)
    angle = torch.cat(angles, dim=-1).repeat_interleave(2, dim=-1)[None, :, None]
    return angle.cos().float(), angle.sin().float()


def rotated(x: torch.Tensor, tables) -> torch.Tensor:
    """x [B, n, H, D] * cos + rotate_half(x) * sin (halves (-x2, x1)), in float32."""
    cos, sin = tables
    first, second = x.float().chunk(2, dim=-1)
    return (x.float() * cos + torch.cat([-second, first], dim=-1) * sin).to(x.dtype)


def project_rotated(attn, hidden: torch.Tensor):
    """q, k, v [B, S, H, D] of diffusers' ErnieImageAttention: q and k normalised per head, then rotated."""
    query, key, value = (proj(hidden).unflatten(-1, (attn.heads, -1)) for proj in (attn.to_q, attn.to_k,
                                                                                     attn.to_v))
    tables = _ROTARY.get()
    return [rotated(attn.norm_q(query), tables), rotated(attn.norm_k(key), tables), value], None


def run_block(block, call) -> None:
    token = _ROTARY.set(call.rotary)
    try:
        call.packed = block(call.packed.transpose(0, 1), None, call.temb, None).transpose(0, 1)
    finally:
        _ROTARY.reset(token)


def head(call) -> torch.Tensor:
    model = call.model
    return model.final_linear(model.final_norm(call.packed.transpose(0, 1), call.c).transpose(0, 1))


def output_tokens(call, tokens: torch.Tensor) -> torch.Tensor:
    """diffusers' (ph, pw, c) patch features -> (c, ph, pw), as TokenGrid writes them."""
    patch = call.config.patch_size
    return tokens.unflatten(-1, (patch, patch, -1)).permute(0, 1, 4, 2, 3).flatten(2)


PLAN = Plan(check=check, layout=layout, condition=condition, head=head, output="packed", output_tokens=output_tokens,
            stages=(Stage("layers", run_block, attends="packed", text=None,
                          attention=AttentionSpec(project=project_rotated)),),
            tensor_parallel=TensorParallelPlan(extra=(Split("mlp.gate_proj", COLUMN), Split("mlp.up_proj", COLUMN),
                                                      Split("mlp.linear_fc2", ROW))))
