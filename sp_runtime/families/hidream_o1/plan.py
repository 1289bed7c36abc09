"""HiDream-O1's sequence-parallel plan for ComfyUI's `diffusion_model(x, timesteps, context, input_ids, position_ids,
ar_len, vinput_mask, token_types)` (HiDreamO1Transformer, comfy/ldm/hidream_o1/model.py; the conds from its
model_base.HiDreamO1.extra_conds): x [B, 3, H, W] raw RGB (H, W multiples of the 32 patch), timesteps sigma x 1000,
input_ids [B, L] the prompt's tokens (the last one <|tms_token|>), position_ids [B or 1, 3, L + image tokens] the
host-built MRoPE positions, ar_len the causal prefix (text before <|tms_token|>). Output: (x - x_pred) / sigma in
float32, sigma clamped at 1e-3.

PLAN: one split stream "sequence" [text | image patches] under a SegmentMask: tokens [0, ar_len) causal, the rest
(<|tms_token|> and the image) see every token: ComfyUI's two-pass attention, exact under Ulysses, Ring and hybrid.
Text rows embedded by embed_tokens, <|tms_token|> rows then replaced by t_embedder1(1000 (1 - sigma)); image rows by
x_embedder. Grouped key / value heads are repeated to the query heads; the interleaved MRoPE is sp.tokens'
PairFrequencies (float32 angles, as ComfyUI's) on q / k reordered so that split-half pairs are adjacent. The head
norms, projects and forms the velocity on this rank's rows. Reference images (HiDreamO1ReferenceImages: ref_patches,
ref_pixel_values) are refused by name.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from ...attention import Segment, SegmentMask
from ...sp import AttentionSpec, Output, Part, Plan, Stage, Stream
from ...sp.tensor_parallel import COLUMN, KEY_VALUE, ROW, Split, TensorParallelPlan, grouped_key_values
from ...sp.tokens import PairFrequencies, TokenGrid, patchify, split_half_order

REFERENCE_INPUTS = ("ref_patches", "ref_pixel_values", "ref_image_grid_thw")
# the decoder layers: query heads split, key / value heads split where the degree divides both counts (32 over 8),
# else kept whole (sp.tensor_parallel.KEY_VALUE); the gated MLP Megatron's way
TENSOR_PARALLEL = TensorParallelPlan(extra=(Split("q_proj", COLUMN), Split("k_proj", KEY_VALUE),
                                            Split("v_proj", KEY_VALUE), Split("o_proj", ROW),
                                            Split("gate_proj", COLUMN), Split("up_proj", COLUMN),
                                            Split("down_proj", ROW)))


def check(call) -> None:
    config, x, inputs = call.config, call.x, call.inputs
    for name in REFERENCE_INPUTS:
        if inputs.get(name) is not None:
            raise ValueError(f"HiDream-O1 reference images ({name}, from HiDreamO1ReferenceImages: edit / "
                             f"multi-reference) are not supported under sequence parallelism yet; this pool serves "
                             f"text to image (switch the template to text to image, or use the stock loader)")
    patch = config.patch_size
    if x.dim() != 4 or x.shape[1] != config.in_channels or x.shape[2] % patch or x.shape[3] % patch:
        raise ValueError(f"x has shape {list(x.shape)}; HiDream-O1 takes [B, 3, H, W] pixels with H and W multiples "
                         f"of {patch}")
    ids, positions, ar_len = inputs.get("input_ids"), inputs.get("position_ids"), inputs.get("ar_len")
    if ids is None or positions is None or ar_len is None:
        raise ValueError("HiDream-O1 needs input_ids, position_ids and ar_len (ComfyUI's HiDreamO1 extra_conds: "
                         "encode the prompt with the checkpoint's own text encoder)")
    total = ids.shape[-1] + (x.shape[2] // patch) * (x.shape[3] // patch)
    if ids.dim() != 2 or ids.shape[0] not in (1, x.shape[0]) or ids.is_floating_point():
        raise ValueError(f"input_ids has shape {list(ids.shape)} ({ids.dtype}); expected integer [B, text tokens]")
    if positions.dim() != 3 or positions.shape[1] != 3 or positions.shape[2] != total:
        raise ValueError(f"position_ids has shape {list(positions.shape)}; expected [B, 3, {total}] (text and image "
                         f"tokens)")
    if not 0 <= int(ar_len) <= ids.shape[-1]:
        raise ValueError(f"ar_len {int(ar_len)} is not within the {ids.shape[-1]} text tokens")
    _check_image_mask(inputs.get("vinput_mask"), ids.shape[-1], total)


def _check_image_mask(mask, text: int, total: int) -> None:
    """vinput_mask (where ComfyUI reads the image rows) must mark exactly the tokens after the text."""
    if mask is None:
        return
    want = torch.arange(total) >= text
    if mask.shape[-1] != total or not bool((mask.bool().cpu() == want).all()):
        raise ValueError("vinput_mask marks other tokens than the image after the text (reference patches?); "
                         "only ComfyUI's text-to-image layout is supported")


def layout(call) -> list[Stream]:
    x, ids = call.input("x"), call.input("input_ids", torch.long)
    patch, text = call.config.patch_size, ids.shape[1]
    grid = TokenGrid.of(x.shape[2], x.shape[3], patch)
    positions = call.inputs["position_ids"][0].to(torch.float32).t()  # [T, 3] (ComfyUI reads row 0)
    call.text_ids, call.x_tokens = ids, patchify(x, patch)
    ar_len = int(call.inputs["ar_len"])
    segments = ([Segment(0, ar_len, True)] if ar_len else []) + [Segment(ar_len, text + grid.count, False)]
    parts = [Part(ids[..., None], positions[:text], _embed_text),
             Part(call.x_tokens, positions[text:], "x_embedder", Output(grid))]
    return [Stream("sequence", parts, mask=SegmentMask(segments))]


def _embed_text(model, raw: torch.Tensor) -> torch.Tensor:
    return model.embed_tokens(raw[..., 0])


def condition(call) -> None:
    """<|tms_token|> rows of this rank become t_embedder1(1000 (1 - sigma)), in the compute dtype."""
    sigma = call.sigma() / 1000.0
    t_emb = call.model.t_embedder1((1.0 - sigma) * 1000, call.sequence.dtype)
    shard, text = call.shards["sequence"], call.text_ids.shape[1]
    ids = call.text_ids.expand(call.batch, -1)[:, shard.lo:min(shard.hi, text)]
    tms = torch.zeros(call.batch, shard.hi - shard.lo, dtype=torch.bool, device=call.device)
    tms[:, :ids.shape[1]] = ids == call.config.tms_token_id
    call.sequence = torch.where(tms[..., None], t_emb[:, None].to(call.sequence.dtype), call.sequence)
    call.sigma_out = sigma.clamp_min(1e-3)


def run_block(block, call) -> None:
    call.sequence = block(call.sequence)


@lru_cache(maxsize=8)
def _pair_order(head_dim: int) -> torch.Tensor:
    return split_half_order(head_dim, head_dim)


def project(attn, hidden: torch.Tensor):
    """q, k, v [B, S, H, D]: q / k normed, key / value heads repeated to the query heads (head h reads group
    h // (H / H_kv), as grouped attention does), q / k channels in rotary-pair order."""
    query = attn.q_norm(attn.q_proj(hidden).unflatten(-1, (attn.heads, -1)))
    key = attn.k_norm(attn.k_proj(hidden).unflatten(-1, (-1, attn.head_dim)))
    value = attn.v_proj(hidden).unflatten(-1, (-1, attn.head_dim))
    key, value = grouped_key_values(attn, [key, value], attn.heads, attn.kv_heads)
    order = _pair_order(query.shape[-1]).to(query.device)
    return [query[..., order].to(value.dtype), key[..., order].to(value.dtype), value], None


def finish(attn, out: torch.Tensor, extra) -> torch.Tensor:
    return attn.o_proj(out)


@lru_cache(maxsize=8)
def _rope(head_dim: int, theta: float, sections: tuple) -> PairFrequencies:
    return PairFrequencies.interleaved_mrope(head_dim, theta, sections)


def rope(config):
    return _rope(config.head_dim, float(config.rope_theta), tuple(config.mrope_section)), None


def head(call) -> torch.Tensor:
    """(x - x_pred) / sigma in float32 on this rank's rows (text rows: zero x, never written out)."""
    model, shard, text = call.model, call.shards["sequence"], call.text_ids.shape[1]
    predicted = model.final_layer2(model.norm(call.sequence)).float()
    first, stop = max(shard.lo - text, 0), max(shard.hi - text, 0)
    x_rows = call.x_tokens[:, first:stop].float()
    x_rows = torch.cat([x_rows.new_zeros(call.batch, predicted.shape[1] - x_rows.shape[1], x_rows.shape[2]),
                        x_rows], dim=1)
    return (x_rows - predicted) / call.sigma_out[:, None, None]


PLAN = Plan(check=check, layout=layout, rope=rope, condition=condition,
            stages=(Stage("layers", run_block, attends="sequence", text=None,
                          attention=AttentionSpec(project=project, finish=finish)),),
            head=head, output="sequence", tensor_parallel=TENSOR_PARALLEL)
