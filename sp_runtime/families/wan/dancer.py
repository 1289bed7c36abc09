"""Wan 2.2 Dancer (music-driven I2V 14B, its "local" and "global" files): a Wan 2.1 I2V with a music encoder
(`music_projection` of ComfyUI's `audio_embed` [B, S, 35] music features, two self-attention layers with 1-D rotary,
then stretched bilinearly to [B, 8 x latent frames, dim]), a `music_injector` cross-attention after some blocks (the
video tokens in 8 x frames equal groups, each attending to its own music vector), `img_emb_refimage` (the reference
image's CLIP features `clip_fea_ref`, image context ahead of clip_fea's) and, when ComfyUI's `fps` does not round to
30, a second patch embedding and head (`patch_embedding_global`, `head_global`) with the frames' rotary positions
spaced 30 / fps apart (the last at round(30 / fps x frames) - 1). `audio_inject_scale` scales the injection.

diffusers has no Dancer, so its modules are stated here with ComfyUI's names (the released files' fused
`music_encoder.*.self_attn.in_proj_*` split into q / k / v) on WanTransformer3DModel. Under SP the video stream is
split as Wan's; the music vectors are replicated (a few hundred) and each rank's tokens attend group by group to
their own (frame_local_attention), so a shard boundary inside a group needs no communication. Under TP the blocks
split as Wan's; the music modules, the global patch embedding and head stay whole.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ...checkpoints.loading import count_blocks, shape_of
from ...sp.cross import Context
from .humo import AudioAttention, frame_local_attention
from .plan import head as wan_head, patch_embedder, per_item
from .variants import Variant, register

NAME = "dancer"
MODULES = ("patch_embedding_global.", "img_emb_refimage.", "head_global.", "music_injector.", "music_projection.",
           "music_encoder.")
# ComfyUI's WanDancerModel: blocks after which the music is injected (its default; detection passes no other), the
# music encoder's head count and rotary base, the music vectors per latent frame, the frame rate of the local model
INJECT_LAYERS = (0, 4, 8, 12, 16, 20, 24, 27)
MUSIC_HEADS, MUSIC_THETA, VECTORS_PER_FRAME, LOCAL_FPS = 4, 10000.0, 8, 30
CLIP_DIM, INJECTOR_EPS = 1280, 1e-6


# ---------------------------------------------------------------------------------------------------------------
# Modules (ComfyUI's names)

class MusicAttention(nn.Module):
    """Self-attention over the music features with 1-D rotary on q / k (interleaved pairs)."""

    def __init__(self, dim: int, device=None):
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(dim, dim, device=device), nn.Linear(dim, dim, device=device)
        self.v_proj, self.out_proj = nn.Linear(dim, dim, device=device), nn.Linear(dim, dim, device=device)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        q, k, v = (proj(x).unflatten(-1, (MUSIC_HEADS, -1)).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(_rotate(q, rotary), _rotate(k, rotary), v)
        return self.out_proj(out.transpose(1, 2).flatten(2))


def _rotate(x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Pairs (x[2i], x[2i + 1]) turned by the rotary angles, in float32 (as ComfyUI's apply_rope1)."""
    cos, sin = rotary
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack([cos * even - sin * odd, sin * even + cos * odd], dim=-1).flatten(-2).type_as(x)


def music_rotary(count: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [count, head_dim / 2] of positions 0..count-1 (ComfyUI's EmbedND over one axis)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    angles = torch.arange(count, dtype=torch.float64)[:, None] * MUSIC_THETA ** -exponents[None]
    return angles.cos().float().to(device), angles.sin().float().to(device)


class MusicLayer(nn.Module):
    """Pre-norm self-attention and a GELU feed-forward (ComfyUI's MusicEncoderLayer)."""

    def __init__(self, dim: int, ffn: int, device=None):
        super().__init__()
        self.self_attn = MusicAttention(dim, device)
        self.linear1, self.linear2 = nn.Linear(dim, ffn, device=device), nn.Linear(ffn, dim, device=device)
        self.norm1, self.norm2 = nn.LayerNorm(dim, device=device), nn.LayerNorm(dim, device=device)

    def forward(self, x: torch.Tensor, rotary) -> torch.Tensor:
        x = x + self.self_attn(self.norm1(x), rotary)
        return x + self.linear2(F.gelu(self.linear1(self.norm2(x))))


class MusicInjector(nn.Module):
    """ComfyUI's AudioInjector_WAN without adaptive norms: one cross-attention per injection."""

    def __init__(self, dim: int, heads: int, count: int, device=None):
        super().__init__()
        self.injector = nn.ModuleList([AudioAttention(dim, dim, heads, INJECTOR_EPS, device) for _ in range(count)])


class GlobalHead(nn.Module):
    """head_global: the output projection and modulation table of the global model (norm_out is shared: no
    weights)."""

    def __init__(self, dim: int, out: int, device=None):
        super().__init__()
        self.head = nn.Linear(dim, out, device=device)
        self.modulation = nn.Parameter(torch.empty(1, 2, dim, device=device))


def clip_projection(dim: int, device=None) -> nn.Sequential:
    """img_emb_refimage.proj: LayerNorm, Linear, GELU, Linear, LayerNorm (ComfyUI's MLPProj)."""
    return nn.Sequential(nn.LayerNorm(CLIP_DIM, device=device), nn.Linear(CLIP_DIM, CLIP_DIM, device=device),
                         nn.GELU(), nn.Linear(CLIP_DIM, dim, device=device), nn.LayerNorm(dim, device=device))


def attach(model, entries: dict) -> None:
    """Give a WanTransformer3DModel (possibly on the meta device) Dancer's modules (entries["dancer"]:
    architecture's)."""
    dancer = entries["dancer"]
    device, dim = model.patch_embedding.weight.device, model.patch_embedding.out_channels
    patch = tuple(model.config.patch_size)
    model.patch_embedding_global = nn.Conv3d(model.config.in_channels, dim, patch, stride=patch, device=device)
    model.img_emb_refimage = nn.Module()
    model.img_emb_refimage.proj = clip_projection(dim, device)
    model.head_global = GlobalHead(dim, model.proj_out.out_features, device)
    model.music_injector = MusicInjector(dim, model.config.num_attention_heads, len(dancer["inject_layers"]), device)
    model.music_projection = nn.Linear(dancer["music_features"], dancer["music_dim"], device=device)
    model.music_encoder = nn.ModuleList([MusicLayer(dancer["music_dim"], dancer["music_ffn"], device)
                                         for _ in range(dancer["music_layers"])])
    model.dancer_inject_layers = list(dancer["inject_layers"])


# ---------------------------------------------------------------------------------------------------------------
# Detection and keys

def architecture(keys: dict, layout: str, config: dict) -> dict:
    """The music encoder's sizes and the injection blocks (a file's k injectors take ComfyUI's first k)."""
    needed = ("music_projection.weight", "music_encoder.0.linear1.weight", "head_global.head.weight",
              "img_emb_refimage.proj.1.weight", "music_injector.injector.0.q.weight")
    missing = [key for key in needed if key not in keys]
    count = count_blocks(keys, "music_injector.injector")
    if missing or count > len(INJECT_LAYERS):
        raise ValueError(f"this Wan Dancer checkpoint (patch_embedding_global) lacks {', '.join(missing)}" if missing
                         else f"this Wan Dancer checkpoint has {count} music injectors; ComfyUI's WanDancerModel "
                              f"injects after at most {len(INJECT_LAYERS)} blocks")
    music_dim, features = shape_of(keys, "music_projection.weight")
    return {"dancer": {"music_features": features, "music_dim": music_dim,
                       "music_ffn": shape_of(keys, "music_encoder.0.linear1.weight")[0],
                       "music_layers": count_blocks(keys, "music_encoder"),
                       "inject_layers": list(INJECT_LAYERS[:count])}}


def key_targets(key: str):
    """music_encoder keys: the released files' fused in_proj rows split into q_proj / k_proj / v_proj (as ComfyUI's
    WAN22_WanDancer.process_unet_state_dict); every other key under its own name."""
    stem, _, kind = key.rpartition(".")
    if not kind.startswith("in_proj_"):
        return [(key, None)]
    suffix = kind.removeprefix("in_proj_")
    return [(f"{stem}.{name}.{suffix}", partial(_third, index))
            for index, name in enumerate(("q_proj", "k_proj", "v_proj"))]


def _third(index: int, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.chunk(3, dim=0)[index]


# ---------------------------------------------------------------------------------------------------------------
# The call

def is_global(call) -> bool:
    """ComfyUI's rule: the global modules when fps does not round to 30."""
    fps = call.inputs.get("fps")
    return fps is not None and int(float(fps) + 0.5) != LOCAL_FPS


def check(call) -> None:
    inputs, batch = call.inputs, call.batch
    for name in ("time_dim_concat", "reference_latent"):
        if inputs.get(name) is not None:
            raise ValueError(f"{name} is not taken by ulysses-sp's Wan Dancer (ComfyUI's WanDancerVideo gives none)")
    fps = inputs.get("fps")
    if fps is not None and not float(fps) > 0:
        raise ValueError(f"fps is {fps}; Wan Dancer takes a positive frame rate (WanDancerEncodeAudio's)")
    features = call.model.music_projection.in_features
    _expect("audio_embed", inputs.get("audio_embed"), batch, (None, features), "music features")
    _expect("clip_fea_ref", inputs.get("clip_fea_ref"), batch, (None, CLIP_DIM), "CLIP vision features")


def _expect(name: str, tensor, batch: int, shape, what: str) -> None:
    if tensor is None:
        return
    if (tensor.dim() != 3 or tensor.shape[0] not in (1, batch) or not tensor.shape[1]
            or any(want is not None and got != want for got, want in zip(tensor.shape[1:], shape))):
        raise ValueError(f"{name} has shape {list(tensor.shape)}; Wan Dancer takes {what} [B, N, {shape[1]}]")


def layout(call, streams) -> None:
    """Global mode: the video embedded by patch_embedding_global, its frames at 30 / fps spacing (computed in the
    compute dtype, as ComfyUI's rope_encode)."""
    if not is_global(call):
        return
    video = streams[0].parts[0]
    frames = video.output.grid.frames
    spacing = 30.0 / float(call.inputs["fps"])
    times = torch.arange(frames, dtype=call.dtype) * spacing
    times[-1] = int(spacing * frames + 0.5) - 1
    video.ids = video.ids.to(call.dtype)
    video.ids[:, 0] = times.to(video.ids.device)[video.ids[:, 0].long()]
    video.embed = patch_embedder(call, "patch_embedding_global")


def prepare(call) -> None:
    """The reference image's context ahead of clip_fea's, and the music vectors of this call (or None)."""
    model, batch = call.model, call.batch
    image = call.context.image if call.inputs.get("clip_fea") is not None else None
    if call.inputs.get("clip_fea_ref") is not None:
        reference = model.img_emb_refimage.proj(per_item(call.input("clip_fea_ref"), batch))
        image = reference if image is None else torch.cat([reference, image], dim=1)
    call.context = Context(call.context.text, image)  # neither: ComfyUI's empty image context adds nothing
    call.dancer_music = None
    if call.inputs.get("audio_embed") is None:
        return
    grid = call.shards["video"].stream.parts[0].output.grid
    groups = VECTORS_PER_FRAME * grid.frames
    if grid.count % groups:
        raise ValueError(f"Wan Dancer's music injection splits each latent frame's {grid.per_frame} tokens into "
                         f"{VECTORS_PER_FRAME} equal groups: give a size whose token count per frame (latent rows / 2 "
                         f"x columns / 2) is a multiple of {VECTORS_PER_FRAME}")
    music = encode_music(model, per_item(call.input("audio_embed"), batch))
    vectors = F.interpolate(music.unsqueeze(1), size=(groups, model.patch_embedding.out_channels),
                            mode="bilinear").squeeze(1)
    call.dancer_music = (vectors.unsqueeze(2), grid.count // groups)


def encode_music(model, features: torch.Tensor) -> torch.Tensor:
    """audio_embed [B, S, 35] -> music features [B, S, music_dim]."""
    music = model.music_projection(features)
    rotary = music_rotary(music.shape[1], music.shape[2] // MUSIC_HEADS, music.device)
    for layer in model.music_encoder:
        music = layer(music, rotary)
    return music


def after(call, index: int, block) -> None:
    """After an injection block: each of this rank's video tokens attends to its group's music vector."""
    layers = call.model.dancer_inject_layers
    shard = call.shards["video"]
    mine = max(0, min(shard.hi, shard.stream.parts[0].count) - shard.lo)
    if call.dancer_music is None or index not in layers or not mine:
        return
    vectors, per_group = call.dancer_music
    video = call.video[:, :mine]
    normed = F.layer_norm(video, (video.shape[-1],), eps=INJECTOR_EPS)
    attention = call.model.music_injector.injector[layers.index(index)]
    out = frame_local_attention(attention, normed, vectors, shard.lo, per_group)
    scale = call.inputs.get("audio_inject_scale")
    scale = 1.0 if scale is None else float(scale)
    call.video = torch.cat([video + out * scale, call.video[:, mine:]], dim=1)


def head(call) -> torch.Tensor:
    """Global mode: head_global's table and projection; else Wan's head."""
    if not is_global(call):
        return wan_head(call)
    return wan_head(call, call.model.head_global.modulation, call.model.head_global.head)


DANCER = register(Variant(
    NAME, applies=lambda model, variant: variant == NAME, anchor="patch_embedding_global.", architecture=architecture,
    variant=lambda config: NAME if config.get("dancer") else None, own_keys=MODULES, key_targets=key_targets,
    mapped_keys=("music_encoder.",), config_keys=("dancer",), attach=attach,
    info=lambda model: {"music_inject_layers": model.dancer_inject_layers}, comfy={NAME: "WAN22_WanDancer"},
    inputs={NAME: ("audio_embed", "clip_fea_ref", "fps", "audio_inject_scale")}, rope_options=False, check=check,
    layout=layout, prepare=prepare, after=after, head=head, tensor_parallel=True))
