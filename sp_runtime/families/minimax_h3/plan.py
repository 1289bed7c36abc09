"""MiniMax H3's sequence-parallel PLAN for ComfyUI's MiniMaxH3Model call as the host packs it (host.py).

Pool call: x [B, 1, N], the video latent [B, C, T, H, W] and the stereo audio latent [B, A, 2, Ta] flattened per item
and concatenated (input `latent_shapes`); timestep the video sigma x 1000 (the first entry, as ComfyUI reads it);
context the text encoder's states [B, L, text_dim]; first / last frames (fl2va) as `keyframe_latents` (a list of
[1, C, t, H, W], noise-augmented as ComfyUI augments them) at `keyframe_frames` (their resolved pixel-frame indices),
run at timestep max(t, `keyframe_timestep`); MiniMaxH3AddGuide's audio guides as `keyframe_audio_latents`
([1, A, 2, t]) at `keyframe_audio_frames`, run at max(t_audio, `audio_cond_timestep`); ref2va / omni-ref's reference blocks as `references` (a list of
{"kind": image / video / video_audio / audio, "latent": [1, C, t, h, w] at the block's own size, "audio":
[1, A, 2, t]}, noise-augmented by the host), their audio rows at max(t_audio, `audio_cond_timestep`);
`text_token_tags` [L] the text encoder's per-token modality tags (0 on vision pads, 1 on text);
`sigma_shift_video` / `sigma_shift_audio` (12, 3); FastH3's head bank reads `sample_sigmas`. Output: ComfyUI's
[-video velocity, -audio velocity], packed like x.

PLAN: one split stream "packed" in ComfyUI's order [text | keyframe rows | reference blocks | audio | video] (each
reference block on its own time span ahead of the targets, a clip's audio rows before its video rows): the prompt refined on
every rank (token refiner, text alone), each rank embedding its own rows; every block is full self-attention over
the whole sequence, AdaLN per row from its (timestep, modality) pair; 3-axis rotary on 6 x rope_freq_dim channels
of each head, whose split-half pairs are brought next to each other (a permutation of q and k channels, which keeps
q . k) so the executor's interleaved rotary applies; both output heads on every row, each part writing its own.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...sp import AttentionSpec, Output, Part, Plan, Stage, Stream, project_qkv
from ...sp.tokens import split_half_order as rotary_pairs  # noqa: F401 (loading.py reads it here)
from ..ltx2.plan import unpack

FRAME_PER_TOKEN = (1, 4, 4, 4, 4)   # pixel frames per latent frame, repeating (ComfyUI's time axis)
FRAME_RESCALE = 5.0 / 3.0
KEYFRAME_TIMESTEP = 0.999
SHIFTS = (12.0, 3.0)                # video / audio sigma shifts (ComfyUI's MiniMaxH3 sampling settings)
TAGS = {"text": 1, "keyframe": 0, "reference": 0, "ref_audio": 2, "audio": 2, "video": 0}
REFERENCE_KINDS = ("image", "video", "video_audio", "audio")
UNSERVED = {"refs": "ComfyUI's raw reference blocks (the pool takes `references`, as host.py builds them)",
            "denoise_mask": "a partial video denoise mask",
            "audio_denoise_mask": "a partial audio denoise mask"}


def check(call) -> None:
    config, x, inputs = call.config, call.x, call.inputs
    unserved = [f"{name} ({what})" for name, what in UNSERVED.items() if inputs.get(name) is not None]
    if unserved:
        raise ValueError(f"MiniMax H3 inputs not supported under sequence parallelism yet: {', '.join(unserved)}")
    shapes = inputs.get("latent_shapes")
    if not isinstance(shapes, (list, tuple)) or len(shapes) != 2 or len(shapes[0]) != 5 or len(shapes[1]) != 4:
        raise ValueError("MiniMax H3 takes x packed with input latent_shapes [[B, C, T, H, W], [B, A, 2, Ta]] "
                         f"(video, audio); got latent_shapes={shapes!r}")
    video, audio = ([int(size) for size in shape] for shape in shapes)
    if x.dim() != 3 or x.shape[1] != 1 or x.shape[2] != math.prod(video[1:]) + math.prod(audio[1:]):
        raise ValueError(f"x has shape {list(x.shape)}; latent_shapes {shapes} pack into [B, 1, "
                         f"{math.prod(video[1:]) + math.prod(audio[1:])}]")
    if video[1] != config.in_channels or audio[1] != config.audio_in_channels or audio[2] != 2 or audio[3] < 1:
        raise ValueError(f"latent_shapes {shapes}: this MiniMax H3 takes {config.in_channels} video channels and "
                         f"stereo audio of {config.audio_in_channels} channels")
    if video[3] % 2 or video[4] % 2:
        raise ValueError(f"a {video[3]}x{video[4]} video latent is not whole 2x2 patches (ComfyUI's MiniMax H3 "
                         f"canvases are multiples of 32 pixels)")
    context = inputs.get("context")
    if context is None or context.dim() != 3 or context.shape[-1] not in (config.text_dim, config.hidden_size):
        raise ValueError(f"MiniMax H3 needs context [batch, text tokens, {config.text_dim}]; got "
                         f"{None if context is None else list(context.shape)}")
    frames = list(inputs.get("keyframe_frames") or ())
    latents = list(inputs.get("keyframe_latents") or ())
    if len(frames) != len(latents) or any(latent.dim() != 5 or list(latent.shape[:2]) != [1, video[1]]
                                          or list(latent.shape[3:]) != video[3:] for latent in latents):
        raise ValueError(f"keyframe_latents must be [1, {video[1]}, t, {video[3]}, {video[4]}] latents, one per "
                         f"keyframe_frames entry")
    audio_frames, audio_latents = (list(inputs.get(name) or ()) for name in ("keyframe_audio_frames",
                                                                               "keyframe_audio_latents"))
    if len(audio_frames) != len(audio_latents) or any(latent.dim() != 4 or list(latent.shape[:3]) != [1, audio[1], 2]
                                                      for latent in audio_latents):
        raise ValueError(f"keyframe_audio_latents must be [1, {audio[1]}, 2, t] latents, one per "
                         f"keyframe_audio_frames entry")
    call.audio_keyframes = list(zip(audio_frames, audio_latents))
    call.references = [check_reference(ref, index, video[1], audio[1]) for index, ref in
                       enumerate(inputs.get("references") or ())]
    tags = inputs.get("text_token_tags")
    if tags is not None and (tags.dim() != 1 or tags.shape[0] != context.shape[1] or not bool(((tags >= 0) & (tags <= 2)).all())):
        raise ValueError(f"text_token_tags must be one modality tag (0-2) per text token, [{context.shape[1]}]; got "
                         f"{list(tags.shape)}")
    heads = call.worker.info.config.get("pdd_heads", 1)
    if heads > 1 and inputs.get("sample_sigmas") is None:
        raise ValueError(f"this FastH3 file's {heads} output heads (PDD) need the sampler's sigmas (input "
                         f"sample_sigmas)")
    call.shapes, call.keyframes = (video, audio), list(zip(frames, latents))


def check_reference(ref, index: int, channels: int, audio_channels: int) -> tuple:
    """One reference block -> (kind, video latent or None, audio latent or None), its shapes checked."""
    kind = ref.get("kind") if isinstance(ref, dict) else None
    latent, audio = (ref.get(name) for name in ("latent", "audio")) if kind else (None, None)
    wants_video, wants_audio = kind in ("image", "video", "video_audio"), kind in ("video_audio", "audio")
    bad_video = wants_video != (latent is not None) or latent is not None and (
        latent.dim() != 5 or list(latent.shape[:2]) != [1, channels] or latent.shape[3] % 2 or latent.shape[4] % 2
        or kind == "image" and latent.shape[2] != 1)
    bad_audio = wants_audio != (audio is not None) or audio is not None and (
        audio.dim() != 4 or list(audio.shape[:3]) != [1, audio_channels, 2])
    if kind not in REFERENCE_KINDS or bad_video or bad_audio:
        raise ValueError(f"references[{index}] must be {{'kind': one of {REFERENCE_KINDS}, 'latent': [1, {channels}, "
                         f"t, h, w] (h, w even; t 1 for an image; none for audio), 'audio': [1, {audio_channels}, 2, t] "
                         f"(audio / video_audio only)}}; got kind {kind!r}")
    return kind, latent, audio


# ---------------------------------------------------------------------------------------------------------------
# Layout: ComfyUI's packed sequence and its (t, h, w) positions

def layout(call) -> list[Stream]:
    model = call.model
    video, audio = unpack(call.input("x", torch.float32), call.shapes)
    frames, rows, cols = video.shape[2], video.shape[3] // 2, video.shape[4] // 2
    frame, width_axis = frame_grid(video.shape[3], video.shape[4])
    context = call.input("context")
    text = context if context.shape[-1] == model.config.hidden_size else \
        model.token_refiner(model.context_embedder(context))
    text_ids = torch.zeros(text.shape[1], 3, dtype=torch.float64)
    text_ids[:, 0] = torch.arange(text.shape[1], dtype=torch.float64)
    parts = [Part(text, _ids(text_ids), _as_is)]
    call.kinds = [("text", text.shape[1])]
    cursor = float(text.shape[1]) + sum(reference_span(*ref) for ref in call.references)
    for index, latent in call.keyframes:
        latent = call.ctx.to_device(f"keyframe{len(call.kinds)}", latent, torch.float32)
        origin = cursor + FRAME_RESCALE * float(index)
        _add(call, parts, "keyframe", patchify(latent), video_grid(latent.shape[2], frame, origin), "proj_in")
    ends = (float(width_axis[0]), float(width_axis[-1]))
    for index, latent in call.audio_keyframes:  # after the video keyframes: the rows' order changes no output
        latent = call.ctx.to_device(f"audio_keyframe{len(call.kinds)}", latent, torch.float32)
        _add(call, parts, "ref_audio", latent.permute(0, 2, 3, 1).flatten(1, 2),
             audio_grid(cursor + FRAME_RESCALE * float(index), latent.shape[3], *ends), "audio_proj_in")
    reference_parts(call, parts, float(text.shape[1]), ends)
    audio_rows = audio.permute(0, 2, 3, 1).flatten(1, 2)
    _add(call, parts, "audio", audio_rows, audio_grid(cursor, audio.shape[3], *ends), "audio_proj_in",
         Output(PackedRows(call.shapes, "audio"), None))
    _add(call, parts, "video", patchify(video), video_grid(frames, frame, cursor), "proj_in",
         Output(PackedRows(call.shapes, "video", (frames, rows, cols)), None))
    return [Stream("packed", parts)]


def _add(call, parts: list, kind: str, rows: torch.Tensor, grid: torch.Tensor, embed, output=None) -> None:
    parts.append(Part(rows, _ids(grid), embed, output))
    call.kinds.append((kind, rows.shape[1]))


def reference_span(kind: str, latent, audio) -> float:
    """The time span a reference block takes ahead of the targets (ComfyUI's _ref_t_span)."""
    steps = 0.0 if audio is None else float(audio.shape[-1])
    if kind == "image":
        return 1.0
    if kind == "audio":
        return steps
    return max(steps, FRAME_RESCALE * sum(FRAME_PER_TOKEN[k % 5] for k in range(latent.shape[2])))


def reference_parts(call, parts: list, cursor: float, target_ends: tuple) -> None:
    """The reference blocks' rows from the text's end on, each at its own (t, h, w): an image at one time, a clip's
    audio (at the ends of its own w axis) then its video frames, standalone audio at the target's w ends."""
    for number, (kind, latent, audio) in enumerate(call.references):
        if audio is not None:
            audio = call.ctx.to_device(f"reference_audio{number}", audio, torch.float32)
            ends = target_ends if kind == "audio" else _axis_ends(latent)
            _add(call, parts, "ref_audio", audio.permute(0, 2, 3, 1).flatten(1, 2),
                 audio_grid(cursor, audio.shape[3], *ends), "audio_proj_in")
        if latent is not None:
            latent = call.ctx.to_device(f"reference{number}", latent, torch.float32)
            frame, _ = frame_grid(latent.shape[3], latent.shape[4])
            _add(call, parts, "reference", patchify(latent), video_grid(latent.shape[2], frame, cursor), "proj_in")
        cursor += reference_span(kind, latent, audio)


def _axis_ends(latent: torch.Tensor) -> tuple[float, float]:
    _, axis = frame_grid(latent.shape[3], latent.shape[4])
    return float(axis[0]), float(axis[-1])


def _as_is(model, states: torch.Tensor) -> torch.Tensor:
    return states


def _ids(grid: torch.Tensor) -> torch.Tensor:
    """(t, h, w) positions [n, 3] float64 -> the executor's ids [n, 4] float32 (a zero axis for unrotated channels)."""
    return torch.cat([grid, torch.zeros(grid.shape[0], 1, dtype=grid.dtype)], dim=1).float()


def patchify(latent: torch.Tensor) -> torch.Tensor:
    """[B, C, T, H, W] -> [B, T*(H/2)*(W/2), C*2*2] rows, features (c, ph, pw) as ComfyUI's patchify_video."""
    batch, channels, frames, height, width = latent.shape
    rows = latent.reshape(batch, channels, frames, height // 2, 2, width // 2, 2).permute(0, 2, 3, 5, 1, 4, 6)
    return rows.reshape(batch, frames * (height // 2) * (width // 2), channels * 4)


def frame_grid(height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Area-normalised (h, w) positions [(H/2)*(W/2), 2] of one latent frame's patches, and the w axis."""
    area = math.sqrt(height * width)

    def axis(size):
        count = size // 2
        return (torch.arange(count, dtype=torch.float64) * (size / area / count) + (1.0 - size / area) / 2.0) * 32.0
    rows, cols = torch.meshgrid(axis(height), axis(width), indexing="ij")
    return torch.stack([rows.reshape(-1), cols.reshape(-1)], dim=-1), axis(width)


def video_grid(frames: int, frame: torch.Tensor, origin: float) -> torch.Tensor:
    spans = torch.tensor([FRAME_RESCALE * FRAME_PER_TOKEN[k % 5] for k in range(frames)], dtype=torch.float64)
    times = origin + torch.cat([torch.zeros(1, dtype=torch.float64), spans[:-1].cumsum(0)])
    grid = torch.empty(frames, frame.shape[0], 3, dtype=torch.float64)
    grid[:, :, 0], grid[:, :, 1:] = times[:, None], frame[None]
    return grid.reshape(-1, 3)


def audio_grid(origin: float, steps: int, low: float, high: float) -> torch.Tensor:
    """Channel-major stereo rows: time per latent step, the two channels at the ends of the w axis, h 0."""
    grid = torch.zeros(2 * steps, 3, dtype=torch.float64)
    grid[:, 0] = (origin + torch.arange(steps, dtype=torch.float64)).repeat(2)
    grid[:steps, 2], grid[steps:, 2] = low, high
    return grid


@dataclass(frozen=True)
class PackedRows:
    """Where the rows of the target audio or video go in the packed output [B, 1, N] (sp.Output's grid), negated
    as ComfyUI returns them; row features are [video head | audio head]."""

    shapes: tuple
    kind: str
    patches: tuple = ()

    def write(self, out: torch.Tensor, tokens: torch.Tensor, first: int) -> None:
        video, audio = unpack(out, self.shapes)
        index = torch.arange(first, first + tokens.shape[1])
        if self.kind == "audio":
            channel, step = index // audio.shape[3], index % audio.shape[3]
            audio.permute(0, 2, 3, 1)[:, channel, step] = -tokens[..., video.shape[1] * 4:]
            return
        frames, rows, cols = self.patches
        view = video.unflatten(4, (cols, 2)).unflatten(3, (rows, 2)).permute(0, 2, 3, 5, 1, 4, 6)
        values = -tokens[..., :video.shape[1] * 4].unflatten(-1, (video.shape[1], 2, 2))
        view[:, index // (rows * cols), index // cols % rows, index % cols] = values


# ---------------------------------------------------------------------------------------------------------------
# Conditioning, blocks, head

def time_shift_sigma(sigma: float, from_shift: float, to_shift: float) -> float:
    base = sigma / (from_shift + sigma * (1.0 - from_shift))
    return to_shift * base / (1.0 + (to_shift - 1.0) * base)


def condition(call) -> None:
    """Each part's timestep (video and text at 1 - sigma, audio on its own shifted schedule, keyframes pinned near
    1), the time embedding of the distinct ones, and this rank's rows' AdaLN table rows."""
    model, inputs, shard = call.model, call.inputs, call.shards["packed"]
    sigma = float((call.timestep.flatten()[0] / 1000.0).float().clamp(min=1e-6))
    shift_video = float(inputs.get("sigma_shift_video") or SHIFTS[0])
    shift_audio = float(inputs.get("sigma_shift_audio") or SHIFTS[1])
    times = {"text": 1.0 - sigma, "video": 1.0 - sigma, "audio": 1.0 - time_shift_sigma(sigma, shift_video, shift_audio)}
    times["keyframe"] = times["reference"] = max(times["video"],
                                                 float(inputs.get("keyframe_timestep") or KEYFRAME_TIMESTEP))
    audio_pin = inputs.get("audio_cond_timestep")
    times["ref_audio"] = max(times["audio"], 1.0 if audio_pin is None else float(audio_pin))
    distinct = sorted({times["video"], times["audio"]} | {times[kind] for kind, _ in call.kinds})
    steps = torch.cat([torch.full((count,), distinct.index(times[kind])) for kind, count in call.kinds])
    tags = torch.cat([torch.full((count,), TAGS[kind]) for kind, count in call.kinds])
    if inputs.get("text_token_tags") is not None:
        tags[:call.kinds[0][1]] = inputs["text_token_tags"].long().cpu()
    call.step_rows = steps[shard.lo:shard.hi].to(call.device)
    call.rows = (steps * 3 + tags)[shard.lo:shard.hi].to(call.device)
    embedder = model.time_embedder
    temb = embedder(model.time_proj(torch.tensor(distinct, device=call.device)).to(next(embedder.parameters()).dtype))
    curve = call.worker.info.config.get("adaln_curve_grid")
    call.adaln = temb if curve else torch.nn.functional.silu(temb)
    call.sigma_video, call.shifts = sigma, (shift_video, shift_audio)


def run_block(block, call) -> None:
    width = call.packed.shape[-1]
    table = block.adaln_proj.linear(call.adaln.to(block.adaln_proj.linear.weight.dtype)).view(-1, 6 * width)
    shift, scale, gate, shift2, scale2, gate2 = (part.index_select(0, call.rows) for part in table.chunk(6, dim=-1))
    states = call.packed
    states = states + gate * block.attn(block.norm1(states) * (1.0 + scale) + shift)
    call.packed = states + gate2 * block.ff(block.norm2(states) * (1.0 + scale2) + shift2)


def project_pairs(attn, hidden: torch.Tensor):
    """diffusers' q, k, v with q and k channels in rotary-pair order (attn.rotary_pairs: set by loading, on the CPU;
    moved to the model's device at its first use)."""
    (query, key, value), extra = project_qkv(attn, hidden)
    if attn.rotary_pairs.device != query.device:
        attn.rotary_pairs = attn.rotary_pairs.to(query.device)
    return [query[..., attn.rotary_pairs], key[..., attn.rotary_pairs], value], extra


def rope(config) -> tuple[tuple[int, ...], float]:
    """FluxPosEmbed axes reproducing MiniMax H3's angles: one inv_freq table per axis (t, h, w) and a zero axis."""
    per_axis = 2 * config.rope_freq_dim
    return (per_axis, per_axis, per_axis, config.attention_head_dim - 3 * per_axis), config.rope_theta


def head(call) -> torch.Tensor:
    """The final norm per row's timestep, then both output heads on every row: [video features | audio features]."""
    model = call.model
    linear = model.norm_out.linear
    shift, scale = linear(call.adaln.to(linear.weight.dtype)).chunk(2, dim=-1)
    states = model.norm_out.norm(call.packed) * (1.0 + scale.index_select(0, call.step_rows)) + \
        shift.index_select(0, call.step_rows)
    heads = call.worker.info.config.get("pdd_heads", 1)
    outputs = [pdd_head(call, module, states, heads) if heads > 1 else module(states.to(module.weight.dtype))
               for module in (model.proj_out, model.audio_proj_out)]
    return torch.cat(outputs, dim=-1)


def pdd_head(call, module, states: torch.Tensor, heads: int) -> torch.Tensor:
    """FastH3's head bank (ComfyUI's _pdd_head): head 0 whole, the others offsets from it, a step using the dt-weighted
    mean of the heads its sigma interval spans on the stream's schedule."""
    sigmas = call.ctx.to_device("sample_sigmas", call.inputs["sample_sigmas"], torch.float32).flatten()
    sigma = torch.tensor(call.sigma_video)
    step = int((sigmas.cpu() - sigma).abs().argmin())
    following = sigmas[min(step + 1, sigmas.shape[0] - 1)].cpu()
    start, stop = (round(float(1.0 - time_shift_sigma(float(value), call.shifts[0], 1.0)) * heads)
                   for value in (sigma, following))
    start = min(start, heads - 1)
    stop = max(stop, start + 1)
    flow_shift = call.shifts[0] if module is call.model.proj_out else call.shifts[1]
    grid = torch.linspace(1.0, 0.0, heads + 1, dtype=torch.float64)
    dt = (1.0 - flow_shift * grid / (1.0 + (flow_shift - 1.0) * grid)).diff()[start:stop]
    weights = (dt / dt.sum()).to(states.device, module.weight.dtype)
    rows, biases = module.weight.unflatten(0, (heads, -1)), module.bias.unflatten(0, (heads, -1))
    first = max(start, 1)
    weight = rows[0] + torch.einsum("n,noi->oi", weights[first - start:], rows[first:stop])
    bias = biases[0] + torch.einsum("n,no->o", weights[first - start:], biases[first:stop])
    return torch.nn.functional.linear(states.to(weight.dtype), weight, bias)


PLAN = Plan(check=check, layout=layout, condition=condition, head=head, rope=rope, output="packed",
            stages=(Stage("transformer_blocks", run_block, attends="packed", text=None,
                          attention=AttentionSpec(project=project_pairs)),))
