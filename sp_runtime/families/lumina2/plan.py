"""Lumina 2's sequence-parallel plan (NextDiT as ComfyUI runs Lumina-Image 2.0 / NetaYume, on diffusers'
Lumina2Transformer2DModel): Z-Image's streams and blocks without its padding: the caption and the image are two split
streams, `context_refiner` and `noise_refiner` attend within one, `layers` over their rank-wise union (nothing is
masked: ComfyUI's NextDiT reads past the caption mask, so the order changes nothing). Differences from Z-Image: no
pad tokens, grouped key / value heads (repeated to the query heads before the exchange, as both codes do before
attention), t = 1 - sigma unscaled, rotary theta 10000, SiLU before every modulation."""
from __future__ import annotations

import torch

from ...sp import AttentionSpec, Output, Part, Plan, Stage, Stream
from ...sp.tensor_parallel import KEY_VALUE, Split, TensorParallelPlan, grouped_key_values
from ...sp.tokens import TokenGrid, pad_to_patch, patchify
from ..z_image.plan import caption_block, check_nextdit, image_axes, image_block, join, joint_block, output_tokens
from .detection import PATCH, ROPE_THETA
from .newbie import is_newbie, with_pooled_text

UNSUPPORTED_INPUTS = ("ref_latents", "ref_contexts", "siglip_feats", "direct_context", "ref_frames")


def check(call) -> None:
    check_nextdit(call, "Lumina 2", UNSUPPORTED_INPUTS, "Z-Image Omni / Ming-Image", "the Gemma text encoder")
    # attention_mask and num_tokens are read past as ComfyUI's NextDiT does; so is clip_text_pooled, except by NewBie
    pooled = call.inputs.get("clip_text_pooled")
    if pooled is not None and is_newbie(call.model):
        width = call.model.clip_text_pooled_proj[1].in_features
        if pooled.dim() != 2 or pooled.shape[-1] != width or pooled.shape[0] not in (1, call.x.shape[0]):
            raise ValueError(f"clip_text_pooled has shape {tuple(pooled.shape)}; NewBie takes [batch, {width}] (the "
                             f"Jina CLIP text encoder's pooled output)")


def layout(call) -> list[Stream]:
    """Caption ids (1 + i, 0, 0); image ids (captions + 1, row, col) with rows and columns under rope_options;
    image patches in ComfyUI's (row, col, channel) feature order."""
    context, x = call.input("context"), call.input("x")
    captions = context.shape[1]
    caption_ids = torch.zeros(captions, 3)
    caption_ids[:, 0] = torch.arange(captions) + 1
    grid = TokenGrid.of(x.shape[-2], x.shape[-1], PATCH)
    tokens = patchify(pad_to_patch(x, PATCH), PATCH).unflatten(-1, (x.shape[1], PATCH, PATCH))
    image_ids = torch.zeros(grid.count, 3)
    image_ids[:, 0] = captions + 1
    rows, cols = image_axes(grid.rows, grid.cols, call.inputs.get("rope_options"))
    image_ids[:, 1] = rows.repeat_interleave(grid.cols)
    image_ids[:, 2] = cols.repeat(grid.rows)
    image = Part(tokens.permute(0, 1, 3, 4, 2).flatten(2), image_ids, "x_embedder", Output(grid))
    return [Stream("caption", [Part(context, caption_ids, embed_caption)]), Stream("image", [image])]


def embed_caption(model, raw: torch.Tensor) -> torch.Tensor:
    return model.time_caption_embed.caption_embedder(raw)


def project_grouped_qkv(attn, hidden: torch.Tensor):
    """q, k, v [B, S, heads, D]: the key / value heads normalised, then each repeated for its group of query heads
    (ComfyUI's and diffusers' order: kv head j serves query heads j * n_rep ... j * n_rep + n_rep - 1)."""
    query = attn.to_q(hidden).unflatten(-1, (attn.heads, -1))
    head_dim = query.shape[-1]
    key, value = (proj(hidden).unflatten(-1, (-1, head_dim)) for proj in (attn.to_k, attn.to_v))
    query, key = attn.norm_q(query).to(value.dtype), attn.norm_k(key).to(value.dtype)
    # at TP: this rank's query heads, each with its key / value head (split with them or kept whole: KEY_VALUE)
    key, value = grouped_key_values(attn, [key, value], attn.heads, getattr(attn, "tp_kv_heads", key.shape[2]))
    return [query, key, value], None


def condition(call) -> None:
    """ComfyUI's t_embedder(1 - sigma) (time_scale 1): sinusoids in float32, cast to the compute dtype, the MLP;
    NewBie's pooled text joined to it (newbie.py)."""
    embed = call.model.time_caption_embed
    call.adaln = embed.timestep_embedder(embed.time_proj(1 - call.sigma()).to(call.dtype))
    if is_newbie(call.model):
        pooled = call.input("clip_text_pooled") if call.inputs.get("clip_text_pooled") is not None else None
        call.adaln = with_pooled_text(call.model, call.adaln, pooled)


GROUPED = AttentionSpec(project=project_grouped_qkv)
# the generic plan, with the key / value heads split where the degree divides both head counts, else kept whole
TENSOR_PARALLEL = TensorParallelPlan(extra=(Split("to_k", KEY_VALUE), Split("to_v", KEY_VALUE)))
PLAN = Plan(check=check, layout=layout, rope=lambda config: (config.axes_dim_rope, ROPE_THETA),
            condition=condition,
            stages=(Stage("context_refiner", caption_block, attends="caption", text=None, attention=GROUPED),
                    Stage("noise_refiner", image_block, attends="image", text=None, attention=GROUPED),
                    Stage("layers", joint_block, attends=("caption", "image"), text=None, attention=GROUPED,
                          before=join)),
            head=lambda call: call.model.norm_out(call.joint[:, call.caption.shape[1]:], call.adaln),
            output_tokens=output_tokens, tensor_parallel=TENSOR_PARALLEL)
