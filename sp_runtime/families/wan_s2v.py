"""Wan 2.2 S2V (speech-to-video) under Ulysses SP: ComfyUI's `audio_embed` [B, layers, audio_dim, 4T] encoded to
audio tokens per latent frame and injected after some blocks by a frame-local cross-attention (ComfyUI's
AudioInjector_WAN, its query normed by the frame's global audio vector); `reference_latent` [B, 16, Tr, H, W] and
`reference_motion` [B, 16, Tm, H, W] (FramePack motion frames at three resolutions) as extra tokens after the
video's, with their own rotary positions (negative or fractional for the motion) and timestep 0; `control_video`
patch-embedded onto the video tokens.

diffusers has no S2V, so its modules are stated here with ComfyUI's names (the checkpoint keys load as they are) on
top of diffusers' WanTransformer3DModel. SP plan: the sequence [video | reference | motion] is split evenly; the
extra tokens (a frame or two) are embedded whole on the ranks whose share reaches them; the audio tokens are
replicated and each rank's video tokens attend frame by frame to their own frame's (frame_local_attention), so a
shard boundary inside a frame needs no communication.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..sp.video_tokens import VideoGrid, conv_patch_embed, pad_to_patch_3d
from .wan_common import WanSinusoid, wrap_pad
from .wan_humo import AudioAttention, frame_local_attention

LATENT_CHANNELS = 16
MOTION_BUCKETS = (1, 2, 16)      # FramePack: the nearest motion frame at full size, 2 at 2x, 16 at 4x downsampling
MOTION_T_STARTS = (-1, -3, -19)  # their first rotary frame positions (ComfyUI's FramePackMotioner)
INJECTOR_EPS, ADAIN_EPS, ENCODER_EPS = 1e-6, 1e-5, 1e-6
ROPE_THETA = 10000.0


# ---------------------------------------------------------------------------------------------------------------
# Modules (ComfyUI's names)

class CausalConv1d(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int, device=None):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, 3, stride=stride, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (2, 0), mode="replicate"))


class MotionEncoder(nn.Module):
    """ComfyUI's MotionEncoder_tc with its global branch: features [b, c, f] -> global vectors [b, t, 1, dim] and
    local tokens [b, t, tokens + 1, dim] (t = ceil(f / 4); a learned padding token last)."""

    def __init__(self, in_dim: int, dim: int, tokens: int, device=None):
        super().__init__()
        self.tokens = tokens
        self.conv1_local = CausalConv1d(in_dim, dim // 4 * tokens, 1, device)
        self.conv1_global = CausalConv1d(in_dim, dim // 4, 1, device)
        self.conv2 = CausalConv1d(dim // 4, dim // 2, 2, device)
        self.conv3 = CausalConv1d(dim // 2, dim, 2, device)
        self.final_linear = nn.Linear(dim, dim, device=device)
        self.padding_tokens = nn.Parameter(torch.empty(1, 1, 1, dim, device=device))

    def _downsample(self, x: torch.Tensor) -> torch.Tensor:
        """The first convolution's output [n, c, f] through norm, SiLU and the two strided convolutions: [n, t, dim]."""
        for conv in (None, self.conv2, self.conv3):
            x = x if conv is None else conv(x)
            x = F.silu(F.layer_norm(x.transpose(1, 2), (x.shape[1],), eps=ENCODER_EPS)).transpose(1, 2)
        return x.transpose(1, 2)

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch = features.shape[0]
        local = self.conv1_local(features).unflatten(1, (self.tokens, -1)).flatten(0, 1)
        local = self._downsample(local).unflatten(0, (batch, self.tokens)).transpose(1, 2)
        padding = self.padding_tokens.to(local.dtype).expand(batch, local.shape[1], 1, -1)
        vectors = self.final_linear(self._downsample(self.conv1_global(features)))
        return vectors.unsqueeze(2), torch.cat([local, padding], dim=2)


class CausalAudioEncoder(nn.Module):
    """audio_embed [b, layers, audio_dim, f] -> its layers mixed by learned weights -> MotionEncoder."""

    def __init__(self, audio_dim: int, layers: int, dim: int, tokens: int, device=None):
        super().__init__()
        self.weights = nn.Parameter(torch.empty(1, layers, 1, 1, device=device))
        self.encoder = MotionEncoder(audio_dim, dim, tokens, device)

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights = F.silu(self.weights.to(features.dtype))
        return self.encoder((features * weights / weights.sum(dim=1, keepdim=True)).sum(dim=1))


class AdaptiveNorm(nn.Module):
    """ComfyUI's AdaLayerNorm: shift and scale of a LayerNorm from a vector."""

    def __init__(self, dim: int, device=None):
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim, device=device)

    def forward(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), eps=ADAIN_EPS) * (1 + scale) + shift

    def modulation(self, vectors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shift, scale = self.linear(F.silu(vectors)).chunk(2, dim=-1)
        return shift, scale


class AudioInjector(nn.Module):
    """ComfyUI's AudioInjector_WAN (adaptive-norm mode): per injection a norm and a cross-attention to the audio."""

    def __init__(self, dim: int, heads: int, count: int, device=None):
        super().__init__()
        self.injector = nn.ModuleList([AudioAttention(dim, dim, heads, INJECTOR_EPS, device) for _ in range(count)])
        self.injector_adain_layers = nn.ModuleList([AdaptiveNorm(dim, device) for _ in range(count)])


class FramePacker(nn.Module):
    """ComfyUI's FramePackMotioner: the last 19 motion frames (zeros before fewer) as tokens at three resolutions,
    nearest first."""

    def __init__(self, dim: int, device=None):
        super().__init__()
        self.proj = nn.Conv3d(LATENT_CHANNELS, dim, (1, 2, 2), stride=(1, 2, 2), device=device)
        self.proj_2x = nn.Conv3d(LATENT_CHANNELS, dim, (2, 4, 4), stride=(2, 4, 4), device=device)
        self.proj_4x = nn.Conv3d(LATENT_CHANNELS, dim, (4, 8, 8), stride=(4, 8, 8), device=device)

    def forward(self, motion: torch.Tensor) -> torch.Tensor:
        frames = sum(MOTION_BUCKETS)
        kept = min(frames, motion.shape[2])
        padded = motion.new_zeros(*motion.shape[:2], frames, *motion.shape[3:])
        padded[:, :, frames - kept:] = motion[:, :, motion.shape[2] - kept:]
        far, middle, near = padded.split(MOTION_BUCKETS[::-1], dim=2)
        parts = [conv(part).flatten(2).transpose(1, 2)
                 for conv, part in ((self.proj, near), (self.proj_2x, middle), (self.proj_4x, far))]
        return torch.cat(parts, dim=1)


def attach_s2v_modules(model, s2v: dict) -> None:
    """Give a WanTransformer3DModel (possibly on the meta device) S2V's modules (s2v: from s2v_architecture)."""
    device = model.patch_embedding.weight.device
    dim, patch = model.patch_embedding.out_channels, tuple(model.config.patch_size)
    model.trainable_cond_mask = nn.Embedding(3, dim, device=device)
    model.casual_audio_encoder = CausalAudioEncoder(s2v["audio_dim"], s2v["audio_layers"], dim, s2v["audio_tokens"],
                                                    device)
    if s2v["cond_dim"]:
        model.cond_encoder = nn.Conv3d(s2v["cond_dim"], dim, patch, stride=patch, device=device)
    model.audio_injector = AudioInjector(dim, model.config.num_attention_heads, len(s2v["inject_layers"]), device)
    model.frame_packer = FramePacker(dim, device)
    model.s2v_inject_layers = list(s2v["inject_layers"])


# ---------------------------------------------------------------------------------------------------------------
# Rotary positions (ComfyUI's, which are not always whole numbers) and their cos / sin

def rope_positions(starts, lengths, steps, dtype: torch.dtype) -> torch.Tensor:
    """[n, 3] (frame, row, col) positions as ComfyUI's WanModel.rope_encode gives them: per axis `steps` evenly
    spaced values from start to start + length - 1, computed in the model's dtype as ComfyUI does."""
    axes = [torch.linspace(start, start + length - 1, count, dtype=dtype)
            for start, length, count in zip(starts, lengths, steps)]
    return torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)


def rope_lengths(shape_thw, patch) -> tuple[int, ...]:
    """ComfyUI's rope_encode lengths of a latent (T, H, W): each rounded to the nearest whole patch count."""
    return tuple((size + p // 2) // p for size, p in zip(shape_thw, patch))


def motion_positions(height: int, width: int, patch, dtype: torch.dtype) -> torch.Tensor:
    """Positions of FramePacker's tokens: the motion latent's rows and columns spread over each resolution's grid."""
    _, rows, cols = rope_lengths((1, height, width), patch)
    grids = ((1, rows, cols), (1, height // 4, width // 4), (4, height // 8, width // 8))
    return torch.cat([rope_positions((start, 0, 0), (steps[0], rows, cols), steps, dtype)
                      for start, steps in zip(MOTION_T_STARTS, grids)])


def rotary_at(rope, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [1, n, 1, D/2] at any (frame, row, col) positions [n, 3], by diffusers' own rotary formula (the
    one its WanRotaryPosEmbed tables hold for whole positions)."""
    from diffusers.models.embeddings import get_1d_rotary_pos_embed
    tables = [get_1d_rotary_pos_embed(size, positions[:, axis].double(), ROPE_THETA, use_real=True,
                                      repeat_interleave_real=True, freqs_dtype=torch.float64)
              for axis, size in enumerate((rope.t_dim, rope.h_dim, rope.w_dim))]
    cos, sin = (torch.cat([table[part] for table in tables], dim=1) for part in (0, 1))
    return cos[None, :, None, 0::2], sin[None, :, None, 1::2]


# ---------------------------------------------------------------------------------------------------------------
# The sequence-parallel call

@dataclass
class S2VSequence:
    """One call's sequence [video | reference | motion]: its extra inputs and every token's rotary position (the
    same on every rank)."""

    grid: VideoGrid                     # the video's tokens
    reference: Optional[torch.Tensor]   # padded reference latent [b, 16, Tr, H', W'], float32
    motion: Optional[torch.Tensor]      # [b, 16, Tm, Hm, Wm]
    control: Optional[torch.Tensor]     # padded control video, like x
    positions: torch.Tensor             # [tokens, 3]

    @property
    def count(self) -> int:
        return self.positions.shape[0]

    def timestep_entries(self, sigma: torch.Tensor) -> torch.Tensor:
        """ComfyUI's timestep entries: one per video frame, zeros for the reference frames, every entry twice
        with motion frames and 3 zeros after (repeat_e spreads them over the tokens; token_entries here)."""
        if sigma.dim() == 1:
            sigma = sigma[:, None].expand(-1, self.grid.frames)
        if self.reference is not None:
            sigma = torch.cat([sigma, sigma.new_zeros(sigma.shape[0], self.reference.shape[2])], dim=1)
        if self.motion is not None:
            sigma = torch.cat([sigma.repeat_interleave(2, dim=1), sigma.new_zeros(sigma.shape[0],
                                                                                     len(MOTION_BUCKETS))], dim=1)
        return sigma

    def embed(self, model, video: torch.Tensor, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        """Tokens [lo, hi): this rank's patch-embedded video tokens `video` with the control video and the video
        mask added, then its share of the extra tokens."""
        mask = model.trainable_cond_mask.weight.to(dtype)
        if self.control is not None:
            patches = self.grid.patches(self.control, lo, lo + video.shape[1])
            video = video + conv_patch_embed(model.cond_encoder, patches, dtype)
        video = video + mask[0]
        if hi <= self.grid.count:
            return video
        extra = self._extra_tokens(model, mask, dtype)[:, max(lo, self.grid.count) - self.grid.count:
                                                       hi - self.grid.count]
        return torch.cat([video, extra], dim=1)

    def _extra_tokens(self, model, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        parts = []
        if self.reference is not None:
            grid = VideoGrid.of(tuple(self.reference.shape[2:]), self.grid.patch)
            patches = grid.patches(self.reference, 0, grid.count)
            parts.append(conv_patch_embed(model.patch_embedding, patches).to(dtype) + mask[1])
        if self.motion is not None:
            parts.append(model.frame_packer(self.motion.to(dtype)) + mask[2])
        return torch.cat(parts, dim=1)

    def rotary(self, rope, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_at(rope, self.positions[lo:hi])


def prepare_sequence(model, inputs: dict, x: torch.Tensor, grid: VideoGrid, ctx, dtype: torch.dtype) -> S2VSequence:
    """The S2V inputs of this call checked and on the device, with every token's rotary position."""
    check_s2v_inputs(model, inputs, x)
    patch = grid.patch
    positions = [grid.positions(0, grid.count, ctx.device).to(dtype)]
    reference, motion, control = (inputs.get(name) for name in ("reference_latent", "reference_motion",
                                                                  "control_video"))
    if reference is not None:
        reference = ctx.to_device("reference_latent", reference, torch.float32)
        start = max(30, grid.frames + 9)  # ComfyUI's frame position of the reference image
        lengths = rope_lengths(reference.shape[2:], patch)
        positions.append(rope_positions((start, 0, 0), lengths, lengths, dtype).to(ctx.device))
        reference = pad_to_patch_3d(reference, patch)
    if motion is not None:
        motion = ctx.to_device("reference_motion", motion, dtype)
        positions.append(motion_positions(*motion.shape[3:], patch, dtype).to(ctx.device))
    if control is not None:
        control = pad_to_patch_3d(ctx.to_device("control_video", control, dtype), patch)
    return S2VSequence(grid, reference, motion, control, torch.cat(positions))


def check_s2v_inputs(model, inputs: dict, x: torch.Tensor) -> None:
    for name in ("reference_latent", "reference_motion"):
        value = inputs.get(name)
        if value is not None and (value.dim() != 5 or value.shape[1] != LATENT_CHANNELS):
            raise ValueError(f"{name} has shape {list(value.shape)}; Wan S2V takes [B, {LATENT_CHANNELS}, frames, "
                             f"height, width] latents")
    motion = inputs.get("reference_motion")
    if motion is not None and (min(motion.shape[3:]) < 8 or motion.shape[3] % 2 or motion.shape[4] % 2):
        raise ValueError(f"reference_motion has shape {list(motion.shape)}; its height and width must be even and "
                         f"at least 8 (ComfyUI's FramePackMotioner packs 8 x 8 patches)")
    control = inputs.get("control_video")
    if control is not None:
        if getattr(model, "cond_encoder", None) is None:
            raise ValueError("control_video was given, but this Wan S2V checkpoint has no cond_encoder")
        expected = [model.cond_encoder.in_channels, *x.shape[2:]]
        if control.dim() != 5 or list(control.shape[1:]) != expected:
            raise ValueError(f"control_video has shape {list(control.shape)}; this Wan S2V model takes "
                             f"[B, {', '.join(map(str, expected))}] (x's frames, height and width)")


@dataclass
class S2VAudio:
    """The audio tokens and vectors of every latent frame (replicated) and this rank's video tokens [first, stop)."""

    tokens: torch.Tensor     # [b, frames, audio tokens + 1, dim]
    vectors: torch.Tensor    # [b, frames, dim]
    after_block: dict[int, int]
    first: int
    stop: int
    per_frame: int           # video tokens per audio frame

    def add(self, model, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states after block `index`, with that block's audio injection added to the video tokens."""
        injection = self.after_block.get(index)
        count = max(self.stop - self.first, 0)
        if injection is None or not count:
            return hidden
        norm = model.audio_injector.injector_adain_layers[injection]
        shift, scale = norm.modulation(self.vectors)
        frame = torch.arange(self.first, self.stop, device=hidden.device) // self.per_frame
        video = hidden[:, :count]
        query = norm(video, shift[:, frame], scale[:, frame])
        out = frame_local_attention(model.audio_injector.injector[injection], query, self.tokens, self.first,
                                    self.per_frame)
        return torch.cat([video + out, hidden[:, count:]], dim=1)


def prepare_injection(model, inputs: dict, grid: VideoGrid, lo: int, hi: int, ctx, dtype: torch.dtype
                      ) -> Optional[S2VAudio]:
    """The encoded audio of this call (ComfyUI's first 4 entries per latent frame), or None without audio_embed."""
    audio_embed = inputs.get("audio_embed")
    if audio_embed is None:
        return None
    encoder = model.casual_audio_encoder
    layers, audio_dim = encoder.weights.shape[1], encoder.encoder.conv1_local.conv.in_channels
    if audio_embed.dim() != 4 or list(audio_embed.shape[1:3]) != [layers, audio_dim] or not audio_embed.shape[3]:
        raise ValueError(f"audio_embed has shape {list(audio_embed.shape)}; this Wan S2V model takes [B, {layers}, "
                         f"{audio_dim}, 4 x latent frames] (ComfyUI's WanSoundImageToVideo output)")
    audio = ctx.to_device("audio_embed", audio_embed[..., :4 * grid.frames], dtype)
    vectors, tokens = encoder(audio)
    frames = tokens.shape[1]
    if grid.count % frames:
        raise ValueError(f"audio_embed covers {frames} latent frames ({audio_embed.shape[3]} entries, 4 per frame), "
                         f"which do not split x's {grid.count} video tokens evenly: give 4 entries per latent frame")
    after_block = {layer: index for index, layer in enumerate(model.s2v_inject_layers)}
    return S2VAudio(tokens, vectors[:, :, 0], after_block, lo, min(hi, grid.count), grid.count // frames)


# ---------------------------------------------------------------------------------------------------------------
# Single-device reference (wan.reference_forward): diffusers' stock blocks over the whole sequence, written apart
# from the code above where it matters (token ranges, timestep spreading, frame-local attention, output placement)

def reference_forward(model, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      audio_embed: Optional[torch.Tensor] = None, reference_latent: Optional[torch.Tensor] = None,
                      reference_motion: Optional[torch.Tensor] = None, control_video: Optional[torch.Tensor] = None
                      ) -> torch.Tensor:
    """ComfyUI's WanModel_S2V call on one process: the whole sequence through diffusers' WanTransformerBlock with
    its stock attention processors."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    compute, device = model.scale_shift_table.dtype, model.scale_shift_table.device
    hidden, positions, sigma, grid = _whole_sequence(model, x, timestep, reference_latent, reference_motion,
                                                     control_video)
    video = grid.numel()
    rotary = tuple(part.to(device) for part in _whole_rotary(model.rope, positions))
    saved = model.attn_processors, model.condition_embedder.timesteps_proj
    model.set_attn_processor(WanAttnProcessor())
    model.condition_embedder.timesteps_proj = WanSinusoid(model.config.freq_dim)
    try:
        with torch.no_grad():
            temb, projection, text, _ = model.condition_embedder(
                sigma.flatten().to(device), context.to(device, compute), None, timestep_seq_len=hidden.shape[1])
            audio = None if audio_embed is None else model.casual_audio_encoder(
                audio_embed[..., :4 * int(grid[0])].to(device, compute))
            for index, block in enumerate(model.blocks):
                hidden = block(hidden, text, projection.unflatten(2, (6, -1)), rotary)
                if audio is not None and index in model.s2v_inject_layers:
                    injection = model.s2v_inject_layers.index(index)
                    hidden[:, :video] += _whole_injection(model, injection, hidden[:, :video], *audio)
            shift, scale = (model.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2)
            hidden = model.norm_out(hidden.float()) * (1 + scale.squeeze(2)) + shift.squeeze(2)
            out = model.proj_out(hidden.to(compute))[:, :video]
    finally:
        model.set_attn_processor(saved[0])
        model.condition_embedder.timesteps_proj = saved[1]
    return _unpatchify(out, grid, tuple(model.config.patch_size))[:, :, :x.shape[2], :x.shape[3], :x.shape[4]] \
        .to(x.dtype).cpu()


def _whole_sequence(model, x, timestep, reference_latent, reference_motion, control_video):
    """Every token of the call embedded [B, S, dim], their positions [S, 3] and timesteps [B, S] (ComfyUI's entries
    spread as its repeat_e does), and the video's grid."""
    compute, device = model.scale_shift_table.dtype, model.scale_shift_table.device
    patch, batch = tuple(model.config.patch_size), x.shape[0]
    embedded = _float32_embedding(model.patch_embedding, wrap_pad(x, patch).to(device)).to(compute)
    if control_video is not None:
        embedded = embedded + model.cond_encoder(wrap_pad(control_video, patch).to(device, compute))
    mask = model.trainable_cond_mask.weight
    tokens, positions = [embedded.flatten(2).transpose(1, 2) + mask[0]], [_grid_positions(embedded.shape[2:])]
    sigma = timestep.float().reshape(batch, -1).expand(batch, embedded.shape[2]) if timestep.dim() == 1 \
        else timestep.float()
    if reference_latent is not None:
        ref = _float32_embedding(model.patch_embedding, wrap_pad(reference_latent, patch).to(device)).to(compute)
        tokens.append(ref.flatten(2).transpose(1, 2) + mask[1])
        positions.append(_grid_positions(ref.shape[2:]) + torch.tensor([max(30, embedded.shape[2] + 9), 0, 0]))
        sigma = torch.cat([sigma, torch.zeros(batch, reference_latent.shape[2])], dim=1)
    if reference_motion is not None:
        tokens.append(model.frame_packer(reference_motion.to(device, compute)) + mask[2])
        positions.append(motion_positions(*reference_motion.shape[3:], patch, compute).double())
        sigma = torch.cat([sigma.repeat_interleave(2, dim=1), torch.zeros(batch, 3)], dim=1)
    hidden = torch.cat(tokens, dim=1)
    length = hidden.shape[1]
    repeats = length // sigma.shape[1]
    step = repeats if repeats * sigma.shape[1] == length else repeats + 1
    return hidden, torch.cat(positions), sigma.repeat_interleave(step, dim=1)[:, :length], embedded.shape[2:]


def _float32_embedding(conv: nn.Conv3d, x: torch.Tensor) -> torch.Tensor:
    """patch_embedding in float32 whatever the model's dtype, as ComfyUI runs it (its ops cast the weights to x's)."""
    return F.conv3d(x.float(), conv.weight.float(), conv.bias.float(), stride=conv.stride)


def _grid_positions(grid) -> torch.Tensor:
    axes = [torch.arange(n, dtype=torch.float64) for n in grid]
    return torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)


def _unpatchify(tokens: torch.Tensor, grid, patch) -> torch.Tensor:
    """[B, n, pt*ph*pw*C] video tokens -> [B, C, T, H, W] (written apart from VideoGrid.write)."""
    out = tokens.reshape(tokens.shape[0], *grid, *patch, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return out.reshape(tokens.shape[0], out.shape[1], *(n * p for n, p in zip(grid, patch)))


def _whole_rotary(rope, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [1, n, 1, D] as diffusers' WanAttnProcessor takes them (pairs repeated)."""
    from diffusers.models.embeddings import get_1d_rotary_pos_embed
    tables = [get_1d_rotary_pos_embed(size, positions[:, axis].double(), ROPE_THETA, use_real=True,
                                      repeat_interleave_real=True, freqs_dtype=torch.float64)
              for axis, size in enumerate((rope.t_dim, rope.h_dim, rope.w_dim))]
    return tuple(torch.cat([table[part] for table in tables], dim=1)[None, :, None] for part in (0, 1))


def _whole_injection(model, injection: int, video: torch.Tensor, vectors: torch.Tensor, audio: torch.Tensor
                     ) -> torch.Tensor:
    """ComfyUI's AudioInjector_WAN over all video tokens: regrouped per audio frame, one attention per frame."""
    batch, length, dim = video.shape
    frames = audio.shape[1]
    attention = model.audio_injector.injector[injection]
    linear = model.audio_injector.injector_adain_layers[injection].linear
    shift, scale = linear(F.silu(vectors[:, :, 0])).reshape(batch * frames, 1, 2 * dim).chunk(2, dim=2)
    grouped = video.reshape(batch * frames, length // frames, dim)
    query = attention.norm_q(attention.q(F.layer_norm(grouped, (dim,), eps=ADAIN_EPS) * (1 + scale) + shift))
    audio = audio.reshape(batch * frames, audio.shape[2], dim)
    key, value = attention.norm_k(attention.k(audio)), attention.v(audio)
    heads = [part.unflatten(2, (attention.heads, -1)).transpose(1, 2) for part in (query, key, value)]
    out = F.scaled_dot_product_attention(*heads).transpose(1, 2).reshape(batch, length, dim)
    return attention.o(out)
