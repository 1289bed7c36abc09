"""LTX-2, 2.3 and 2.5's sequence-parallel PLAN (run by sp.PlanWorker) for ComfyUI's LTXAV call as the host packs it
(host.py).

Pool call: x [B, 1, N], the video latent [B, 128, F, H, W] and the audio latent [B, 8, T, 16] flattened per item and
concatenated (input `latent_shapes`); timestep the video sigma [B] or per video token; `audio_timestep` [B] or [B, T]
(default: the video's); context the text encoder output (LTX-2.3 / 2.5: its video and audio features side by side),
or LTX-2.0's connector output [B, L', 2C]; `frame_rate` (25); `a2v_gate_sigma` / `v2a_gate_sigma` (default: the
largest audio / video sigma of the call); `keyframe_idxs` [B, 3, G, 2], the pixel bounds of the last G video tokens
(guide frames appended by LTXVAddGuide); `guide_weights` [B, W <= G], the weights of the guide tokens from the
first on (strength, x a guide attention mask's mean there; the video self-attention adds log w between denoised
and guide tokens, guides.py). The output is packed like x (guide frames included).

PLAN: stream "video" split (guide tokens with it), each rank embedding, modulating and writing its own; stream
"audio" replicated (25 tokens per second against thousands per video frame: an exchange per attention would cost
more than it saves), written by sequence rank 0; both prompts through the connectors on every rank; one stage of the
custom audio-video block (block.py). ComfyUI's choices where diffusers differs: the a2v / v2a gates from the other
stream's largest sigma of the call, video times x (1 / frame_rate), q / k norm eps 1e-5 (loading.py), token
positions per the file's use_middle_indices_grid / causal_temporal_positioning. LTX-2.3 / 2.5 add nothing that
crosses tokens (per-token gates, per-item prompt modulation from the item's largest sigma, 2.5's keyframe marker).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ...sp import Output, Part, Plan, Stage, Stream
from ...sp.tensor_parallel import COLUMN, NORM, Split, TensorParallelPlan
from ...sp.video_tokens import VideoGrid
from .block import audio_video_block, conditioning, output_head
from .guides import guide_mask
from .text import connect_text

DEFAULT_FRAME_RATE = 25.0       # ComfyUI's LTXAV default frame_rate
UNIT = (1, 1, 1)                # LTX-2 takes its latents unpatched: one token per latent pixel
VIDEO_CROSS = ("av_cross_attn_video_scale_shift", "av_cross_attn_video_a2v_gate")
AUDIO_CROSS = ("av_cross_attn_audio_scale_shift", "av_cross_attn_audio_v2a_gate")


def check(call) -> None:
    """The latent shapes of a call (call.shapes), checked against x and the model; clear errors for what LTX-2
    cannot take."""
    config, x, inputs = call.config, call.x, call.inputs
    shapes = inputs.get("latent_shapes")
    if not isinstance(shapes, (list, tuple)) or len(shapes) != 2 or len(shapes[0]) != 5 or len(shapes[1]) != 4:
        raise ValueError("LTX-2 takes x packed with input latent_shapes [[B, C, F, H, W], [B, C, T, M]] (video, "
                         f"audio); got latent_shapes={shapes!r}")
    video, audio = ([int(size) for size in shape] for shape in shapes)
    if x.dim() != 3 or x.shape[1] != 1 or x.shape[2] != math.prod(video[1:]) + math.prod(audio[1:]):
        raise ValueError(f"x has shape {list(x.shape)}; latent_shapes {shapes} pack into [B, 1, "
                         f"{math.prod(video[1:]) + math.prod(audio[1:])}]")
    if video[1] != config.in_channels or audio[1] * audio[3] != config.audio_in_channels:
        raise ValueError(f"latent_shapes {shapes}: this LTX-2 takes {config.in_channels} video channels and audio "
                         f"channels x bins = {config.audio_in_channels}")
    if audio[2] == 0:
        raise ValueError("LTX-2 runs audio and video together: an empty audio latent (video-only generation) is "
                         "not supported under sequence parallelism yet")
    mask = inputs.get("attention_mask")
    if mask is not None and not bool((mask != 0).all()):
        raise ValueError("LTX-2 takes no text attention mask with padding (ComfyUI's connectors pad the prompt with "
                         "learnable registers instead); give the unpadded prompt")
    call.shapes = (video, audio)


@dataclass(frozen=True)
class PackedOutput:
    """Where one modality's output tokens go in the packed output [B, 1, N] (sp.Output's grid): the video's token
    grid, or (grid None) the audio's time steps, features (channel, bin)."""

    shapes: tuple
    grid: Optional[VideoGrid] = None

    def write(self, out: torch.Tensor, tokens: torch.Tensor, first: int) -> None:
        video, audio = unpack(out, self.shapes)
        if self.grid is not None:
            self.grid.write(video, tokens, first)
        else:
            rows = tokens.unflatten(2, (audio.shape[1], audio.shape[3])).transpose(1, 2)
            audio[:, :, first:first + tokens.shape[1]].copy_(rows)


def unpack(packed: torch.Tensor, shapes) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed [B, 1, N] as views: the video latent [B, C, F, H, W] and the audio latent [B, C, T, M]."""
    video_shape, audio_shape = shapes
    flat = packed.reshape(packed.shape[0], -1)
    split = math.prod(video_shape[1:])
    return (flat[:, :split].view(packed.shape[0], *video_shape[1:]),
            flat[:, split:].view(packed.shape[0], *audio_shape[1:]))


def layout(call) -> list[Stream]:
    """The video tokens (one per latent pixel, features the channels) split; the audio's time steps (features
    channel x bin) replicated."""
    video, audio = unpack(call.input("x"), call.shapes)
    call.grid = grid = VideoGrid.of(tuple(call.shapes[0][2:]), UNIT)
    video_out, audio_out = Output(PackedOutput(call.shapes, grid), None), Output(PackedOutput(call.shapes), None)
    video_part = Part(grid.patches(video, 0, grid.count), None, "proj_in", video_out)
    audio_part = Part(audio.transpose(1, 2).flatten(2), None, "audio_proj_in", audio_out)
    return [Stream("video", [video_part]), Stream("audio", [audio_part], split=False)]


def condition(call) -> None:
    """Sigmas, the prompts, this rank's positions and rotary, each modality's modulations (call.video_cond,
    call.audio_cond) and LTX-2.5's keyframe marker on this rank's video states."""
    model, config, inputs, batch, device, dtype = (call.model, call.config, call.inputs, call.batch, call.device,
                                                   call.dtype)
    grid, shard = call.grid, call.shards["video"]
    audio_frames = call.shapes[1][2]
    full_sigma = _per_token(call.ctx.to_device("timestep", call.timestep, torch.float32), batch, grid.count,
                            "video timestep")
    sigma = full_sigma[:, shard.lo:shard.hi] if full_sigma.shape[1] > 1 else full_sigma
    audio_sigma = _audio_sigma(call, full_sigma, audio_frames)
    a2v_gate, v2a_gate = (_gate_sigma(call, name, default) for name, default in
                          (("a2v_gate_sigma", audio_sigma), ("v2a_gate_sigma", full_sigma)))
    frame_rate = float(inputs.get("frame_rate") or DEFAULT_FRAME_RATE)
    video_text, audio_text = connect_text(model, call.input("context"))
    keyframes = _keyframe_positions(call)
    coords = comfy_video_coords(model, batch, (grid.frames, grid.rows, grid.cols), frame_rate, device,
                                keyframes)[:, :, shard.lo:shard.hi]
    audio_coords = model.audio_rope.prepare_audio_coords(batch, audio_frames, device)
    middle = call.worker.info.config["use_middle_indices_grid"]
    scale = config.timestep_scale_multiplier
    gate_factor = config.cross_attn_timestep_scale_multiplier / scale
    call.video_cond = conditioning(model, "", batch, sigma * scale, a2v_gate * scale * gate_factor,
                                   model.rope(_self_positions(coords, middle), device=device),
                                   model.cross_attn_rope(coords[:, 0:1], device=device), video_text, VIDEO_CROSS,
                                   dtype)
    call.audio_cond = conditioning(model, "audio_", batch, audio_sigma * scale, v2a_gate * scale * gate_factor,
                                   model.audio_rope(_self_positions(audio_coords, middle), device=device),
                                   model.cross_attn_audio_rope(audio_coords[:, 0:1], device=device), audio_text,
                                   AUDIO_CROSS, dtype)
    if model.prompt_modulation and config.use_prompt_adaln_single:
        call.video_cond.prompt_temb = _prompt_temb(model.prompt_adaln, full_sigma * scale, dtype)
        call.audio_cond.prompt_temb = _prompt_temb(model.audio_prompt_adaln, audio_sigma * scale, dtype)
    guides = 0 if keyframes is None else keyframes.shape[2]
    call.video_cond.mask = _guide_mask(call, guides)
    call.video = mark_pixel_frames(model, call.video, coords, (shard.lo, shard.hi), grid.count - guides)


def run_block(block, call) -> None:
    call.video, call.audio = audio_video_block(block, call.video, call.audio, call.video_cond, call.audio_cond,
                                               call.seq, call.shards["video"].shards)


def head(call) -> tuple[torch.Tensor, torch.Tensor]:
    return (output_head(call.model, call.video, call.video_cond, ""),
            output_head(call.model, call.audio, call.audio_cond, "audio_"))


# the generic plan (every attention's q / k / v and output, both FeedForwards) and, in each attention, the q / k
# norms across heads (NORM: their mean square summed over the TP group) and LTX-2.3's per-head gate logits
TENSOR_PARALLEL = TensorParallelPlan(extra=(Split("norm_q", NORM), Split("norm_k", NORM),
                                            Split("to_gate_logits", COLUMN)))

PLAN = Plan(check=check, layout=layout, condition=condition, head=head, output=("video", "audio"),
            stages=(Stage("transformer_blocks", run_block, attends="video", text=None, attention=None),),
            tensor_parallel=TENSOR_PARALLEL)


# ---------------------------------------------------------------------------------------------------------------
# Sigmas and positions

def _per_token(timestep: torch.Tensor, batch: int, tokens: int, what: str) -> torch.Tensor:
    """A sigma [B] or per token [B, N] (or [B, N, 1]) -> [B, 1] or [B, N]."""
    timestep = timestep.reshape(batch, -1) if timestep.dim() > 1 else timestep.reshape(batch, 1)
    if timestep.shape[1] not in (1, tokens):
        raise ValueError(f"{what} has {timestep.shape[1]} entries per item; give one, or one per {what[:5]} token "
                         f"({tokens})")
    return timestep


def _audio_sigma(call, video_sigma: torch.Tensor, frames: int) -> torch.Tensor:
    """Input audio_timestep as [B, 1] or [B, T]; the video's sigma when the call gives none and it is one per item."""
    given = call.inputs.get("audio_timestep")
    if given is not None:
        return _per_token(call.ctx.to_device("audio_timestep", given, torch.float32), call.batch, frames,
                          "audio timestep")
    if video_sigma.shape[1] == 1:
        return video_sigma
    raise ValueError("a per-token video timestep needs audio_timestep ([B] or one per audio token)")


def _gate_sigma(call, name: str, sigmas: torch.Tensor) -> torch.Tensor:
    """A cross-modal gate's sigma as [B, 1]: the input `name`, else the largest of `sigmas` (ComfyUI's choice)."""
    given = call.inputs.get(name)
    value = sigmas.max() if given is None else call.ctx.to_device(name, torch.as_tensor(given), torch.float32)
    if value.numel() != 1:
        raise ValueError(f"{name} is one sigma for the whole call; got shape {list(value.shape)}")
    return value.reshape(1, 1).expand(call.batch, 1)


def prompt_sigma(sigma: torch.Tensor) -> torch.Tensor:
    """[B, 1 or N] -> [B]: the sigma of LTX-2.3's prompt AdaLN, each item's largest over its tokens (ComfyUI's
    compute_prompt_timestep)."""
    return sigma.amax(dim=1)


def _prompt_temb(module, sigma: torch.Tensor, dtype) -> torch.Tensor:
    values, _ = module(prompt_sigma(sigma), batch_size=sigma.shape[0], hidden_dtype=dtype)
    return values.view(sigma.shape[0], 1, -1)


def _keyframe_positions(call) -> Optional[torch.Tensor]:
    """Input keyframe_idxs, checked: the pixel-space [start, end) bounds [B or 1, 3, G, 2] of the last G video
    tokens, whole latent frames (the guide frames LTXVAddGuide appends to the latent); None without guides."""
    given, grid = call.inputs.get("keyframe_idxs"), call.grid
    if given is None:
        return None
    positions = call.ctx.to_device("keyframe_idxs", given, torch.float32)
    shape = list(positions.shape)
    per_frame = grid.rows * grid.cols
    if (len(shape) != 4 or shape[0] not in (1, call.batch) or shape[1] != 3 or shape[3] != 2
            or not 0 < shape[2] <= grid.count or shape[2] % per_frame):
        raise ValueError(f"keyframe_idxs has shape {shape}; give the guide tokens' pixel bounds [B, 3, G, 2], G "
                         f"whole latent frames of {per_frame} tokens, at most the {grid.count} video tokens "
                         f"(ComfyUI's LTXVAddGuide makes them; crop the guides before upscaling the latent)")
    return positions


def _guide_mask(call, guides: int):
    """Input guide_weights (LTXVAddGuide's weights per guide token) as the video self-attention's GuideMask."""
    given = call.inputs.get("guide_weights")
    if given is None:
        return None
    if not guides:
        raise ValueError("guide_weights needs guide tokens: give keyframe_idxs too")
    weights = call.ctx.to_device("guide_weights", given, torch.float32)
    return guide_mask(weights, call.grid.count, guides, call.dtype)


def comfy_video_coords(model, batch: int, shape: tuple[int, int, int], frame_rate: float, device,
                       keyframes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The video tokens' [start, end) bounds [B, 3, N, 2] as ComfyUI computes them: latent corners x the VAE factors,
    the first frame's causal fix where the file asks for it (model.rope.causal_offset, set at load), the last G
    tokens' bounds replaced by `keyframes` [B or 1, 3, G, 2] (guides: they keep the bounds of the frames they
    condition), time x (1 / frame_rate) (diffusers divides by the rate, which rounds differently)."""
    coords = model.rope.prepare_video_coords(batch, *shape, device, fps=1.0)
    if keyframes is not None:
        coords[:, :, coords.shape[2] - keyframes.shape[2]:] = keyframes
    coords[:, 0] = coords[:, 0] * (1.0 / frame_rate)
    return coords


def _self_positions(coords: torch.Tensor, middle: bool) -> torch.Tensor:
    """Self-attention positions: the token middles ([start, end) bounds, which diffusers' rope averages) or, for a
    file without use_middle_indices_grid, the starts (ComfyUI's choice)."""
    return coords if middle else coords[..., 0]


def mark_pixel_frames(model, hidden: torch.Tensor, coords: torch.Tensor, token_range: tuple[int, int],
                      guide_start: int) -> torch.Tensor:
    """LTX-2.5's learned keyframe marker added to the tokens that encode one pixel frame, as ComfyUI's newest
    apply_keyframes_abs_pos_embedding: the tokens starting at time 0 (the first latent frame), guide tokens (index
    guide_start on) excepted; `coords` [B, 3, n, 2] and `hidden` [B, n, dim] are the tokens token_range of the
    video. Files without the marker (LTX-2, 2.3) pass unchanged."""
    if not model.config.use_keyframes_abs_pos_embedding:
        return hidden
    index = torch.arange(*token_range, device=hidden.device)
    marked = (coords[:, 0, :, 0] == 0) & (index < guide_start)
    return hidden + marked.unsqueeze(-1).to(hidden.dtype) * model.keyframes_abs_pos_embedding.to(hidden.dtype)
