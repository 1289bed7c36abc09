"""Wan 2.2 S2V (speech-to-video): ComfyUI's `audio_embed` [B, layers, audio_dim, 4T] encoded to audio tokens per latent
frame and injected after some blocks by a frame-local cross-attention (ComfyUI's AudioInjector_WAN, its query
normed by the frame's global audio vector); `reference_latent` [B, 16, Tr, H, W] and `reference_motion`
[B, 16, Tm, H, W] (FramePack motion frames at three resolutions) as extra tokens after the video's, with their own
rotary positions (negative or fractional for the motion) and timestep 0; `control_video` patch-embedded onto the
video tokens.

diffusers has no S2V, so its modules are stated here with ComfyUI's names (the checkpoint keys load as they are) on
top of diffusers' WanTransformer3DModel. Under SP the video stream is [video | reference | motion] parts, split in
balanced shards (the motion tokens are packed whole on every rank: a few convolutions); the audio tokens are
replicated and each rank's video tokens attend frame by frame to their own frame's (frame_local_attention), so a
shard boundary inside a frame needs no communication.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...sp import Part, video_part
from ...sp.video_tokens import conv_patch_embed, pad_to_patch_3d
from ...checkpoints.loading import count_blocks, shape_of
from .humo import AudioAttention, frame_local_attention
from .plan import patch_embedder
from .variants import Variant, register

LATENT_CHANNELS = 16
MOTION_BUCKETS = (1, 2, 16)      # FramePack: the nearest motion frame at full size, 2 at 2x, 16 at 4x downsampling
MOTION_T_STARTS = (-1, -3, -19)  # their first rotary frame positions (ComfyUI's FramePackMotioner)
INJECTOR_EPS, ADAIN_EPS, ENCODER_EPS = 1e-6, 1e-5, 1e-6


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


def attach(model, entries: dict) -> None:
    """Give a WanTransformer3DModel (possibly on the meta device) S2V's modules (entries["s2v"]: architecture's)."""
    s2v = entries["s2v"]
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


S2V_MODULES = ("trainable_cond_mask.", "casual_audio_encoder.", "cond_encoder.", "audio_injector.", "frame_packer.")
# the blocks after which ComfyUI's WanModel_S2V injects audio (its default; its detection passes no other)
COMFY_S2V_INJECT_LAYERS = (0, 4, 8, 12, 16, 20, 24, 27, 30, 33, 36, 39)


def architecture(keys: dict, layout: str, config: dict) -> dict:
    """Wan 2.2 S2V's audio encoder sizes, control-video channels and the blocks after which audio is injected:
    ComfyUI's WanModel_S2V injects after the blocks of a fixed list (the 14B release's 12 injectors), so a file's k
    injectors take its first k."""
    count = count_blocks(keys, "audio_injector.injector")
    if "audio_injector.injector_adain_layers.0.linear.weight" not in keys or not 0 < count <= len(
            COMFY_S2V_INJECT_LAYERS):
        raise ValueError(f"this Wan S2V checkpoint has {count} audio injectors and "
                         f"{count_blocks(keys, 'audio_injector.injector_adain_layers')} adaptive norms; ComfyUI's "
                         f"WanModel_S2V takes 1 to {len(COMFY_S2V_INJECT_LAYERS)} injectors, each with its norm")
    local_channels, audio_dim, _ = shape_of(keys, "casual_audio_encoder.encoder.conv1_local.conv.weight")
    return {"s2v": {"audio_dim": audio_dim, "audio_layers": shape_of(keys, "casual_audio_encoder.weights")[1],
                    "audio_tokens": local_channels // (config["inner_dim"] // 4),
                    "cond_dim": shape_of(keys, "cond_encoder.weight")[1] if "cond_encoder.weight" in keys else 0,
                    "inject_layers": list(COMFY_S2V_INJECT_LAYERS[:count])}}


# ---------------------------------------------------------------------------------------------------------------
# The call: [video | reference | motion] parts, ComfyUI's timestep entries, the control video, audio injections

def check(call) -> None:
    if call.inputs.get("time_dim_concat") is not None:
        raise ValueError("time_dim_concat is not taken by a Wan s2v model (as ComfyUI's WanModel_S2V: its extra "
                         "frames come as reference_latent)")
    check_s2v_inputs(call.model, call.inputs, call.x)


def layout(call, streams) -> None:
    """The video's positions in the compute dtype (as ComfyUI's rope_encode), then the reference's and the motion's
    parts, each with its trainable_cond_mask row."""
    dtype, patch, video = call.dtype, tuple(call.config.patch_size), streams[0].parts[0]
    mask = call.model.trainable_cond_mask.weight.to(dtype)
    grid = video.output.grid
    video.ids = video.ids.to(dtype)
    if call.inputs.get("reference_latent") is not None:
        reference = call.input("reference_latent", torch.float32)
        embed = patch_embedder(call)
        part = video_part(reference, patch, lambda model, raw: embed(model, raw) + mask[1], output=False)
        lengths = rope_lengths(reference.shape[2:], patch)
        part.ids = rope_positions((max(30, grid.frames + 9), 0, 0), lengths, lengths, dtype).to(call.device)
        streams[0].parts.append(part)
    if call.inputs.get("reference_motion") is not None:
        motion = call.input("reference_motion")
        ids = motion_positions(*motion.shape[3:], patch, dtype).to(call.device)
        packed = call.model.frame_packer(motion)
        streams[0].parts.append(Part(packed, ids, lambda model, raw: raw + mask[2]))


def timesteps(call, sigma: torch.Tensor) -> torch.Tensor:
    """ComfyUI's timestep entries: one per video frame, zeros for the reference frames, every entry twice with
    motion frames and 3 zeros after (repeat_e spreads them over the tokens)."""
    frames = call.shards["video"].stream.parts[0].output.grid.frames
    if sigma.dim() == 1:
        sigma = sigma[:, None].expand(-1, frames)
    if call.inputs.get("reference_latent") is not None:
        sigma = torch.cat([sigma, sigma.new_zeros(sigma.shape[0], call.inputs["reference_latent"].shape[2])], dim=1)
    if call.inputs.get("reference_motion") is not None:
        sigma = torch.cat([sigma.repeat_interleave(2, dim=1), sigma.new_zeros(sigma.shape[0], len(MOTION_BUCKETS))],
                          dim=1)
    return sigma


def _video_tokens(call) -> tuple[int, int]:
    """(this rank's first token, how many of its tokens are the video's)."""
    shard = call.shards["video"]
    return shard.lo, max(0, min(shard.hi, shard.stream.parts[0].count) - shard.lo)


def embed(call) -> None:
    """This rank's video tokens with the control video and the video mask added."""
    lo, mine = _video_tokens(call)
    video = call.video[:, :mine]
    if call.inputs.get("control_video") is not None:
        grid = call.shards["video"].stream.parts[0].output.grid
        control = pad_to_patch_3d(call.input("control_video"), tuple(call.config.patch_size))
        video = video + conv_patch_embed(call.model.cond_encoder, grid.patches(control, lo, lo + mine), call.dtype)
    video = video + call.model.trainable_cond_mask.weight.to(call.dtype)[0]
    call.video = torch.cat([video, call.video[:, mine:]], dim=1)


def prepare(call) -> None:
    """The encoded audio of this call (ComfyUI's first 4 entries per latent frame), or None without audio_embed."""
    call.s2v_audio = None
    audio_embed = call.inputs.get("audio_embed")
    if audio_embed is None:
        return
    encoder = call.model.casual_audio_encoder
    layers, audio_dim = encoder.weights.shape[1], encoder.encoder.conv1_local.conv.in_channels
    if audio_embed.dim() != 4 or list(audio_embed.shape[1:3]) != [layers, audio_dim] or not audio_embed.shape[3]:
        raise ValueError(f"audio_embed has shape {list(audio_embed.shape)}; this Wan S2V model takes [B, {layers}, "
                         f"{audio_dim}, 4 x latent frames] (ComfyUI's WanSoundImageToVideo output)")
    grid = call.shards["video"].stream.parts[0].output.grid
    vectors, tokens = encoder(call.input("audio_embed")[..., :4 * grid.frames])
    frames = tokens.shape[1]
    if grid.count % frames:
        raise ValueError(f"audio_embed covers {frames} latent frames ({audio_embed.shape[3]} entries, 4 per frame), "
                         f"which do not split x's {grid.count} video tokens evenly: give 4 entries per latent frame")
    call.s2v_audio = (tokens, vectors[:, :, 0], grid.count // frames)


def after(call, index: int, block) -> None:
    """After an injection block: the audio injection added to this rank's video tokens."""
    layers = call.model.s2v_inject_layers
    lo, mine = _video_tokens(call)
    if call.s2v_audio is None or index not in layers or not mine:
        return
    tokens, vectors, per_frame = call.s2v_audio
    injection = layers.index(index)
    norm = call.model.audio_injector.injector_adain_layers[injection]
    shift, scale = norm.modulation(vectors)
    frame = torch.arange(lo, lo + mine, device=call.device) // per_frame
    video = call.video[:, :mine]
    query = norm(video, shift[:, frame], scale[:, frame])
    out = frame_local_attention(call.model.audio_injector.injector[injection], query, tokens, lo, per_frame)
    call.video = torch.cat([video + out, call.video[:, mine:]], dim=1)


S2V = register(Variant(
    "s2v", applies=lambda model, variant: getattr(model, "audio_injector", None) is not None,
    anchor="casual_audio_encoder.encoder.final_linear.weight", architecture=architecture,
    variant=lambda config: "s2v" if config.get("s2v") else None, own_keys=S2V_MODULES, config_keys=("s2v",),
    attach=attach, info=lambda model: {"audio_inject_layers": model.s2v_inject_layers}, comfy={"s2v": "WAN22_S2V"},
    inputs={"s2v": ("audio_embed", "reference_motion", "control_video")}, rope_options=False, check=check,
    layout=layout, timesteps=timesteps, embed=embed, prepare=prepare, after=after, tensor_parallel=True))
