"""HiDream-O1's sequence-parallel plan for ComfyUI's `diffusion_model(x, timesteps, context, input_ids, position_ids,
ar_len, vinput_mask, token_types, ref_patches, ref_pixel_values, ref_image_grid_thw)` (HiDreamO1Transformer,
comfy/ldm/hidream_o1/model.py; the conds from its model_base.HiDreamO1.extra_conds): x [B, 3, H, W] raw RGB (H, W
multiples of the 32 patch), timesteps sigma x 1000, input_ids [B, L] the prompt's tokens (the last one
<|tms_token|>; with reference images a [<|vision_start|>, <|image_pad|> x n, <|vision_end|>] run per reference),
position_ids [B or 1, 3, L + image tokens + reference patches] the host-built MRoPE positions, ar_len the causal
prefix (text before <|tms_token|>). Reference images (HiDreamO1ReferenceImages) come two ways: ref_patches
[B, R, 3072] their 32 x 32 patches, which follow the image; ref_pixel_values [B or 1, N, 1536] with
ref_image_grid_thw [B or 1, K, 3] (row 0 read, as ComfyUI) for the vision tower, whose N / 4 outputs replace the
<|image_pad|> rows (at row 0's positions). Output: (x - x_pred) / sigma in float32, sigma clamped at 1e-3.

PLAN: one split stream "sequence" [text | image patches | reference patches] under a SegmentMask: tokens [0, ar_len)
causal, the rest (<|tms_token|>, the image and the references) see every token: ComfyUI's two-pass attention, exact
under Ulysses, Ring and hybrid, in balanced shards. Text rows embedded by embed_tokens, <|image_pad|> rows by the
vision tower's output (run whole on every rank, vision.py, once per generation), <|tms_token|> rows then replaced by
t_embedder1(1000 (1 - sigma)); image and reference rows by x_embedder; only the image's rows are written out. Grouped
key / value heads are repeated to the query heads; the interleaved MRoPE is sp.tokens' PairFrequencies (float32
angles, as ComfyUI's) on q / k reordered so that split-half pairs are adjacent. The head norms, projects and forms
the velocity on this rank's rows.
"""
from __future__ import annotations

from functools import lru_cache, partial

import torch

from ...attention import Segment, SegmentMask
from ...sp import AttentionSpec, Output, Part, Plan, Stage, Stream
from ...sp.tensor_parallel import COLUMN, KEY_VALUE, ROW, Split, TensorParallelPlan, grouped_key_values
from ...sp.tokens import PairFrequencies, TokenGrid, patchify, split_half_order

IMAGE_PAD_ID = 151655  # Qwen3-VL <|image_pad|>: rows the vision tower's output replaces
# the decoder layers: query heads split, key / value heads split where the degree divides both counts (32 over 8),
# else kept whole (sp.tensor_parallel.KEY_VALUE); the gated MLP Megatron's way (the vision tower stays whole)
TENSOR_PARALLEL = TensorParallelPlan(extra=(Split("q_proj", COLUMN), Split("k_proj", KEY_VALUE),
                                            Split("v_proj", KEY_VALUE), Split("o_proj", ROW),
                                            Split("gate_proj", COLUMN), Split("up_proj", COLUMN),
                                            Split("down_proj", ROW)))


def check(call) -> None:
    config, x, inputs = call.config, call.x, call.inputs
    patch = config.patch_size
    if x.dim() != 4 or x.shape[1] != config.in_channels or x.shape[2] % patch or x.shape[3] % patch:
        raise ValueError(f"x has shape {list(x.shape)}; HiDream-O1 takes [B, 3, H, W] pixels with H and W multiples "
                         f"of {patch}")
    ids, positions, ar_len = inputs.get("input_ids"), inputs.get("position_ids"), inputs.get("ar_len")
    if ids is None or positions is None or ar_len is None:
        raise ValueError("HiDream-O1 needs input_ids, position_ids and ar_len (ComfyUI's HiDreamO1 extra_conds: "
                         "encode the prompt with the checkpoint's own text encoder)")
    if ids.dim() != 2 or ids.shape[0] not in (1, x.shape[0]) or ids.is_floating_point():
        raise ValueError(f"input_ids has shape {list(ids.shape)} ({ids.dtype}); expected integer [B, text tokens]")
    references = _check_references(call, ids)
    total = ids.shape[-1] + (x.shape[2] // patch) * (x.shape[3] // patch) + references
    if positions.dim() != 3 or positions.shape[1] != 3 or positions.shape[2] != total:
        raise ValueError(f"position_ids has shape {list(positions.shape)}; expected [B, 3, {total}] (text, image and "
                         f"reference patch tokens)")
    if not 0 <= int(ar_len) <= ids.shape[-1]:
        raise ValueError(f"ar_len {int(ar_len)} is not within the {ids.shape[-1]} text tokens")
    _check_image_mask(inputs.get("vinput_mask"), ids.shape[-1], total)


def _check_references(call, ids: torch.Tensor) -> int:
    """The reference inputs against each other, the prompt and the model; returns the reference patch count."""
    config, x, inputs = call.config, call.x, call.inputs
    patches, pixels, grid = (inputs.get(name) for name in ("ref_patches", "ref_pixel_values", "ref_image_grid_thw"))
    features = config.in_channels * config.patch_size ** 2
    if patches is not None and (patches.dim() != 3 or patches.shape[0] not in (1, x.shape[0])
                                or patches.shape[2] != features):
        raise ValueError(f"ref_patches has shape {list(patches.shape)}; expected [B, reference patches, {features}]")
    if (pixels is None) != (grid is None):
        raise ValueError("HiDream-O1 reference images need both ref_pixel_values and ref_image_grid_thw (ComfyUI's "
                         "HiDreamO1ReferenceImages sets both)")
    pads = int((ids[0] == IMAGE_PAD_ID).sum())
    if pixels is None:
        if pads:
            raise ValueError(f"input_ids hold {pads} <|image_pad|> tokens but no ref_pixel_values came with them")
        return 0 if patches is None else patches.shape[1]
    vision = config.vision
    if not vision:
        raise ValueError("HiDream-O1 reference images (ref_pixel_values) need the vision tower (visual.*), which "
                         "this checkpoint does not hold; use a file with it, or text to image")
    grid = _grid(grid)
    pixel_features = vision["channels"] * vision["temporal"] * vision["patch"] ** 2
    pixels = pixels[0] if pixels.dim() == 3 else pixels
    merge = vision["merge"]
    counts = [t * h * w for t, h, w in grid]
    if pixels.dim() != 2 or pixels.shape[1] != pixel_features or pixels.shape[0] != sum(counts) \
            or any(h % merge or w % merge for _, h, w in grid):
        raise ValueError(f"ref_pixel_values has shape {list(pixels.shape)} for image grids {grid}; expected "
                         f"[{sum(counts)}, {pixel_features}], each grid's height and width multiples of {merge}")
    if pads != sum(counts) // merge ** 2:
        raise ValueError(f"Image-token count {pads} (<|image_pad|> in input_ids) != the vision tower's output count "
                         f"{sum(counts) // merge ** 2} for image grids {grid}")
    return 0 if patches is None else patches.shape[1]


def _grid(grid: torch.Tensor) -> list[list[int]]:
    """ref_image_grid_thw [B or 1, K, 3] or [K, 3] -> [[t, h, w], ...] (row 0, as ComfyUI reads it)."""
    grid = grid[0] if grid.dim() == 3 else grid
    if grid.dim() != 2 or grid.shape[1] != 3 or grid.is_floating_point() or bool((grid <= 0).any()):
        raise ValueError(f"ref_image_grid_thw has shape {list(grid.shape)} ({grid.dtype}); expected positive integer "
                         f"[images, 3] (t, h, w)")
    return [[int(v) for v in row] for row in grid.tolist()]


def _check_image_mask(mask, text: int, total: int) -> None:
    """vinput_mask (where ComfyUI reads the image rows: the first of those it marks) must mark exactly the tokens
    after the text (the image, then any reference patches)."""
    if mask is None:
        return
    want = torch.arange(total) >= text
    if mask.shape[-1] != total or not bool((mask.bool().cpu() == want).all()):
        raise ValueError("vinput_mask marks other tokens than those after the text (the image, then the reference "
                         "patches); only ComfyUI's layout is supported")


def layout(call) -> list[Stream]:
    x, ids = call.input("x"), call.input("input_ids", torch.long)
    patch, text = call.config.patch_size, ids.shape[1]
    grid = TokenGrid.of(x.shape[2], x.shape[3], patch)
    positions = call.inputs["position_ids"][0].to(torch.float32).t()  # [T, 3] (ComfyUI reads row 0)
    call.text_ids, call.x_tokens = ids, patchify(x, patch)
    ar_len = int(call.inputs["ar_len"])
    refs = call.inputs.get("ref_patches")
    refs = None if refs is None else call.input("ref_patches")
    total = text + grid.count + (0 if refs is None else refs.shape[1])
    segments = ([Segment(0, ar_len, True)] if ar_len else []) + [Segment(ar_len, total, False)]
    parts = [_text_part(call, ids, positions[:text]),
             Part(call.x_tokens, positions[text:text + grid.count], "x_embedder", Output(grid))]
    if refs is not None:
        parts.append(Part(refs, positions[text + grid.count:], "x_embedder"))
    return [Stream("sequence", parts, mask=SegmentMask(segments))]


def _text_part(call, ids: torch.Tensor, positions: torch.Tensor) -> Part:
    """The prompt's tokens; with reference pixels each row also carries the vision tower's output row for its
    <|image_pad|> (at row 0's positions, as ComfyUI; -1 elsewhere)."""
    if call.inputs.get("ref_pixel_values") is None:
        return Part(ids[..., None], positions, _embed_text)
    pads = ids[0] == IMAGE_PAD_ID
    rows = torch.where(pads, pads.long().cumsum(0) - 1, -1)
    raw = torch.stack([ids, rows.expand_as(ids)], dim=-1)
    return Part(raw, positions, partial(_embed_text_and_images, _vision(call)))


def _vision(call) -> torch.Tensor:
    """The vision tower's output for the call's reference pixels, computed once per generation: reused while the
    pixels, grids and the tower's weights (each parameter's storage and version: a LoRA rewrites them) equal the last
    call's (the pixels kept on the device; the denoising steps of a generation share them)."""
    given, tower = call.input("ref_pixel_values"), call.model.visual
    pixels, grid = given[0] if given.dim() == 3 else given, _grid(call.inputs["ref_image_grid_thw"])
    weights = tuple((parameter.data_ptr(), parameter._version) for parameter in tower.parameters())
    cached = getattr(call.worker, "vision_cache", None)
    if cached is not None and cached[1:3] == (grid, weights) and cached[0].shape == pixels.shape \
            and torch.equal(cached[0], pixels):
        return cached[3]
    embeds = tower(pixels, grid).to(call.dtype)
    call.worker.vision_cache = (pixels.clone(), grid, weights, embeds)
    return embeds


def _embed_text(model, raw: torch.Tensor) -> torch.Tensor:
    return model.embed_tokens(raw[..., 0])


def _embed_text_and_images(images: torch.Tensor, model, raw: torch.Tensor) -> torch.Tensor:
    states = model.embed_tokens(raw[..., 0])
    rows = raw[..., 1]
    return torch.where((rows >= 0)[..., None], images[rows.clamp_min(0)].to(states.dtype), states)


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
    """(x - x_pred) / sigma in float32 on this rank's rows (text and reference rows: zero x, never written out)."""
    model, shard, text = call.model, call.shards["sequence"], call.text_ids.shape[1]
    predicted = model.final_layer2(model.norm(call.sequence)).float()
    image = call.x_tokens.shape[1]
    first, stop = min(max(shard.lo - text, 0), image), min(max(shard.hi - text, 0), image)
    before = min(max(text - shard.lo, 0), predicted.shape[1])
    x_rows = call.x_tokens[:, first:stop].float()
    pad = lambda rows: x_rows.new_zeros(call.batch, rows, x_rows.shape[2])  # noqa: E731
    x_rows = torch.cat([pad(before), x_rows, pad(predicted.shape[1] - before - x_rows.shape[1])], dim=1)
    return (x_rows - predicted) / call.sigma_out[:, None, None]


PLAN = Plan(check=check, layout=layout, rope=rope, condition=condition,
            stages=(Stage("layers", run_block, attends="sequence", text=None,
                          attention=AttentionSpec(project=project, finish=finish)),),
            head=head, output="sequence", tensor_parallel=TENSOR_PARALLEL)
