"""Boogu-Image's sequence-parallel plan (ComfyUI's BooguTransformer2DModel on modules.py's model): three split
streams, the instruction (caption), the reference latents (edit) and the latent (image). The context, noise and
reference refiners attend within their stream; the double-stream blocks (a custom block) attend jointly over all
three with per-stream projections and, the images alone, over [references; latent]; the single-stream blocks over
the rank-wise union of the three. Rotary positions as ComfyUI's OmniGen2 rope: caption token i at (i, i, i), the
j-th reference at (L + shifts of the earlier ones, row, col) where each shifts by max(rows, cols), the latent after
them; t = 1 - sigma embedded x 1000; the output negated."""
from __future__ import annotations

from functools import partial

import torch

from ...attention import SeqShards
from ...sp import AttentionSpec, Output, Part, Plan, Stage, Stream
from ...sp.processor import Geometry
from ...sp.tensor_parallel import COLUMN, GATHER, KEY_VALUE, ROW, Split, TensorParallelPlan, grouped_key_values
from ...sp.tokens import TokenGrid, as_list
from ..lumina2.plan import embed_caption, project_grouped_qkv
from ..omnigen2.plan import embed_reference, grid_ids, patches
from ..z_image.plan import caption_block, image_block, joint_block, output_tokens
from .detection import PATCH, ROPE_THETA

MAX_REFERENCES = 5  # rows of image_index_embedding


def check(call) -> None:
    """x [B, C, H, W]; context [B or 1, L, features]; every instruction token attended (ComfyUI's model cannot run a
    padded one: its rotary covers num_tokens tokens); at most 5 reference latents [B or 1, C, h, w]."""
    config, x, inputs = call.config, call.x, call.inputs
    if x.dim() != 4 or x.shape[1] != config.in_channels:
        raise ValueError(f"x has shape {tuple(x.shape)}; Boogu-Image takes [B, {config.in_channels}, H, W]")
    context = inputs.get("context")
    if context is None or context.dim() != 3 or context.shape[-1] != config.cap_feat_dim or \
            context.shape[0] not in (1, x.shape[0]):
        raise ValueError(f"Boogu-Image needs context [batch, tokens, {config.cap_feat_dim}] (the Qwen3-VL text "
                         f"encoder output); got {None if context is None else tuple(context.shape)}")
    _check_instruction(inputs.get("attention_mask"), inputs.get("num_tokens"), context.shape[1])
    refs = as_list(inputs.get("ref_latents"))
    if len(refs) > MAX_REFERENCES:
        raise ValueError(f"ref_latents: {len(refs)} reference latents; Boogu-Image embeds at most {MAX_REFERENCES} "
                         f"(its image_index_embedding rows)")
    for number, ref in enumerate(refs):
        if ref.dim() != 4 or ref.shape[1] != config.in_channels or ref.shape[0] not in (1, x.shape[0]):
            raise ValueError(f"ref_latents[{number}] has shape {tuple(ref.shape)}; Boogu-Image takes [B or 1, "
                             f"{config.in_channels}, h, w]")


def _check_instruction(mask, num_tokens, tokens: int) -> None:
    padded = mask is not None and not bool(torch.as_tensor(mask).bool().all())
    if padded or (num_tokens is not None and int(num_tokens) != tokens):
        raise ValueError(f"attention_mask / num_tokens: a padded instruction ({num_tokens} of {tokens} tokens) is "
                         f"not supported: Boogu-Image attends every instruction token (ComfyUI's model places its "
                         f"rotary positions after num_tokens and cannot run a padded one either)")


def layout(call) -> list[Stream]:
    context, x = call.input("context"), call.input("x")
    captions = context.shape[1]
    caption_ids = torch.arange(captions, dtype=torch.float32)[:, None].expand(captions, 3)
    shift, refs = captions, []
    for index, ref in enumerate(as_list(call.inputs.get("ref_latents"))):
        ref = call.ctx.to_device(f"ref_latents.{index}", ref, call.dtype)
        grid = TokenGrid.of(ref.shape[-2], ref.shape[-1], PATCH)
        refs.append(Part(patches(ref), grid_ids(grid, shift), partial(embed_reference, index=index)))
        shift += max(grid.rows, grid.cols)
    if not refs:  # an empty stream: the reference refiner is skipped, the joint attention sees no reference
        refs = [Part(x.new_zeros(1, 0, x.shape[1] * PATCH * PATCH), torch.zeros(0, 3),
                     partial(embed_reference, index=0))]
    grid = TokenGrid.of(x.shape[-2], x.shape[-1], PATCH)
    return [Stream("caption", [Part(context, caption_ids, embed_caption)]), Stream("ref", refs),
            Stream("image", [Part(patches(x), grid_ids(grid, shift), "x_embedder", Output(grid))])]


def condition(call) -> None:
    """ComfyUI's time_caption_embed on 1 - sigma: sinusoids (x 1000) in float32, cast to the compute dtype, the MLP."""
    embed = call.model.time_caption_embed
    call.adaln = embed.timestep_embedder(embed.time_proj(1 - call.sigma()).to(call.dtype))


def reference_block(block, call) -> None:
    if call.shards["ref"].stream.total:
        call.ref = block(call.ref, None, None, call.adaln)


def union_geometry(call, names: tuple[str, ...]) -> Geometry:
    """The attention geometry of the rank-wise union of split streams (each rank's shards in `names` order)."""
    shards = [call.shards[name] for name in names]
    rope = tuple(torch.cat(pieces) for pieces in zip(*(shard.rope for shard in shards)))
    return Geometry(call.seq, SeqShards.union(*(shard.shards for shard in shards)), rope)


def double_geometries(call) -> None:
    call.joint_geometry = union_geometry(call, ("caption", "ref", "image"))
    call.image_geometry = union_geometry(call, ("ref", "image"))


def double_block(block, call) -> None:
    """ComfyUI's BooguDoubleStreamBlock on this rank's tokens: both streams' modulations from the block's inputs,
    the joint attention and the images' self-attention, then the gated residuals in ComfyUI's order."""
    temb, refs, text = call.adaln, call.ref.shape[1], call.caption
    image = torch.cat([call.ref, call.image], dim=1)
    img_joint_in, img_gate, img_scale_mlp, img_gate_mlp = block.img_norm1(image, temb)
    img_mlp_in, img_shift_mlp, _, _ = block.img_norm2(image, temb)
    img_self_in, img_gate_self, _, _ = block.img_norm3(image, temb)
    text_joint_in, text_gate, text_scale_mlp, text_gate_mlp = block.instruct_norm1(text, temb)
    text_mlp_in, text_shift_mlp, _, _ = block.instruct_norm2(text, temb)
    text_attn, img_attn = joint_attention(block.img_instruct_attn, text_joint_in, img_joint_in, call.joint_geometry)
    qkv, _ = project_grouped_qkv(block.img_self_attn, img_self_in)
    img_self = block.img_self_attn.to_out[0](call.image_geometry.attend(qkv)[0].flatten(2, 3).to(qkv[2].dtype))
    image = image + _gate(img_gate) * block.img_attn_norm(img_attn)
    image = image + _gate(img_gate_self) * block.img_self_attn_norm(img_self)
    mlp = block.img_feed_forward(block.img_ffn_norm1((1 + img_scale_mlp[:, None]) * img_mlp_in +
                                                     img_shift_mlp[:, None]))
    image = image + _gate(img_gate_mlp) * block.img_ffn_norm2(mlp)
    text = text + _gate(text_gate) * block.instruct_attn_norm(text_attn)
    mlp = block.instruct_feed_forward(block.instruct_ffn_norm1((1 + text_scale_mlp[:, None]) * text_mlp_in +
                                                               text_shift_mlp[:, None]))
    call.caption = text + _gate(text_gate_mlp) * block.instruct_ffn_norm2(mlp)
    call.ref, call.image = image[:, :refs], image[:, refs:]


def _gate(gate: torch.Tensor) -> torch.Tensor:
    return gate[:, None].tanh()


def joint_attention(attn, text: torch.Tensor, image: torch.Tensor, geometry: Geometry):
    """[text; image] attention with per-stream q / k / v (key / value heads repeated to the query heads), the
    per-stream output projections, then the shared to_out: (text out, image out)."""
    projections = attn.processor

    def heads(kind: str) -> torch.Tensor:
        both = torch.cat([getattr(projections, f"instruct_to_{kind}")(text),
                          getattr(projections, f"img_to_{kind}")(image)], dim=1)
        return both.unflatten(-1, (-1, attn.head_dim))
    query, key, value = heads("q"), heads("k"), heads("v")
    query, key = attn.norm_q(query).to(value.dtype), attn.norm_k(key).to(value.dtype)
    key, value = grouped_key_values(attn, [key, value], attn.heads, getattr(attn, "tp_kv_heads", key.shape[2]))
    out = geometry.attend([query, key, value])
    out = out[0].flatten(2, 3).to(value.dtype)
    words = text.shape[1]
    return attn.to_out[0](projections.instruct_out(out[:, :words])), attn.to_out[0](projections.img_out(out[:, words:]))


def join(call) -> None:
    call.joint = torch.cat([call.caption, call.ref, call.image], dim=1)


GROUPED = AttentionSpec(project=project_grouped_qkv)
# the joint attention (its heads split, balanced) with its per-stream projections split by whole heads (q by columns,
# k / v too where the degree divides both head counts, else kept whole: KEY_VALUE; the per-stream outputs by rows,
# summed), its shared to_out then whole on every rank (gathered); the other attentions' key / value heads as Lumina 2's
JOINT_SPLITS = (*(Split(f"{stream}_to_q", COLUMN) for stream in ("img", "instruct")),
                *(Split(f"{stream}_to_{kind}", KEY_VALUE) for stream in ("img", "instruct") for kind in "kv"),
                Split("img_out", ROW), Split("instruct_out", ROW), Split("img_instruct_attn.to_out.0", GATHER),
                Split("to_k", KEY_VALUE), Split("to_v", KEY_VALUE))
PLAN = Plan(check=check, layout=layout, rope=lambda config: (config.axes_dim_rope, ROPE_THETA), condition=condition,
            stages=(Stage("context_refiner", caption_block, attends="caption", text=None, attention=GROUPED),
                    Stage("noise_refiner", image_block, attends="image", text=None, attention=GROUPED),
                    Stage("ref_image_refiner", reference_block, attends="ref", text=None, attention=GROUPED),
                    Stage("double_stream_layers", double_block, attends=("caption", "ref", "image"), text=None,
                          attention=None, before=double_geometries),
                    Stage("single_stream_layers", joint_block, attends=("caption", "ref", "image"), text=None,
                          attention=GROUPED, before=join)),
            head=lambda call: call.model.norm_out(call.joint[:, call.caption.shape[1] + call.ref.shape[1]:],
                                                  call.adaln),
            output_tokens=output_tokens, tensor_parallel=TensorParallelPlan(extra=JOINT_SPLITS,
                                                                               attentions=("img_instruct_attn",)))
