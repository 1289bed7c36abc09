"""Wan's single-device references (the tests' side): diffusers' stock forward with ComfyUI's call convention around
it, each variant's inputs given as diffusers (or a hook standing in for a module diffusers lacks) takes them. Written
apart from the plan (sp_runtime.families.wan) on purpose."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from sp_runtime.families.wan import load_model
from sp_runtime.families.wan.plan import token_entries, wan_sinusoid
from sp_runtime.families.wan.humo import AUDIO_TOKENS
from sp_runtime.families.wan.s2v import ADAIN_EPS, motion_positions
from sp_lab.references import as_model

ROPE_THETA = 10000.0

class WanSinusoid(torch.nn.Module):
    """wan_sinusoid as the module diffusers' condition embedder calls (the single-device references)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, timestep: torch.Tensor) -> torch.Tensor:
        return wan_sinusoid(self.dim, timestep)


def wrap_pad(latent: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """Circular padding by concatenating each axis' first entries (written apart from pad_to_patch_3d)."""
    for axis, size in enumerate(patch, start=2):
        extra = (-latent.shape[axis]) % size
        if extra:
            latent = torch.cat([latent, latent.narrow(axis, 0, extra)], dim=axis)
    return latent


def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      clip_fea: Optional[torch.Tensor] = None, time_dim_concat: Optional[torch.Tensor] = None,
                      dtype: str = "default", head_dim: Optional[int] = None,
                      vace_context: Optional[torch.Tensor] = None, vace_strength: Optional[list] = None,
                      reference_latent: Optional[torch.Tensor] = None,
                      camera_conditions: Optional[torch.Tensor] = None, audio_embed: Optional[torch.Tensor] = None,
                      reference_motion: Optional[torch.Tensor] = None, control_video: Optional[torch.Tensor] = None,
                      pose_latents: Optional[torch.Tensor] = None, face_pixel_values: Optional[torch.Tensor] = None,
                      **_ignored) -> torch.Tensor:
    """ComfyUI's Wan diffusion_model(...) computed by diffusers' own WanTransformer3DModel.forward on one process.

    Around the stock call: circular padding and cropping as ComfyUI, per-frame timesteps spread over their tokens
    (diffusers' per-token form), FLF2V's [B, 2N] CLIP features given as diffusers' [2B, N] pairs, and one
    departure inside: Wan's own timestep sinusoid (wan_sinusoid) replaces diffusers' Timesteps. diffusers' I2V
    processor assumes exactly 512 text tokens, so image models need context [B, 512, D] here. VACE: diffusers takes
    one hint video, so vace_context must hold one ([B, 1, C, T, H, W]); its strength scales every VACE layer.
    Fun Control's reference_latent: the stock forward on a latent one frame longer, whose frame 0 patch_embedding
    gives as ref_conv(reference_latent) (ReferenceFirstEmbedding), that frame cropped from the output.
    Fun Camera: the adapter's output added to patch_embedding's (CameraAddedEmbedding). HuMo:
    reference_latent frames appended as time_dim_concat's, audio attention hooked in (audio_reference_hooks).
    S2V: s2v_reference_forward (diffusers' stock blocks over its whole sequence).
    Animate: diffusers' own pose and face inputs, which it needs with matching frame counts
    (diffusers_arguments); without a face video, the face adapter switched off
    (no_face_reference).
    """
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    model = as_model(model_or_path, load_model, dtype, options={"head_dim": head_dim} if head_dim else None)
    if getattr(model, "audio_injector", None) is not None:
        return s2v_reference_forward(model, x, timestep, context, audio_embed, reference_latent, reference_motion,
                                     control_video)
    compute, device = model.scale_shift_table.dtype, model.scale_shift_table.device
    patch = tuple(model.config.patch_size)
    humo = getattr(model, "audio_proj", None) is not None
    if humo and reference_latent is not None:
        time_dim_concat, reference_latent = reference_latent, None
    latent = wrap_pad(x, patch)
    if time_dim_concat is not None:
        latent = torch.cat([latent, wrap_pad(time_dim_concat, patch).expand(x.shape[0], -1, -1, -1, -1)], dim=2)
    lead = int(reference_latent is not None and getattr(model, "ref_conv", None) is not None)
    if lead:
        latent = torch.cat([torch.zeros_like(latent[:, :, :1]), latent], dim=2)
    grid = [size // p for size, p in zip(latent.shape[2:], patch)]
    sigma = timestep.reshape(x.shape[0], -1).float()
    if sigma.shape[1] > 1:
        tokens = grid[0] * grid[1] * grid[2]
        sigma = sigma[:, token_entries(sigma.shape[1], tokens, 0, tokens, "cpu")]
    else:
        sigma = sigma[:, 0]
    image = None
    if model.condition_embedder.image_embedder is not None:
        if clip_fea is None or context.shape[1] != 512:
            raise ValueError("the diffusers reference of an image Wan needs clip_fea and 512 text tokens")
        image = clip_fea
        if model.condition_embedder.image_embedder.pos_embed is not None:
            image = clip_fea.reshape(2 * clip_fea.shape[0], clip_fea.shape[1] // 2, clip_fea.shape[2])
        image = image.to(device, compute)
    extra = {} if vace_context is None else _diffusers_vace_arguments(model, vace_context, vace_strength, patch)
    animate = getattr(model, "face_adapter", None) is not None
    if animate:
        pose = None if pose_latents is None else wrap_pad(pose_latents, patch)
        extra = diffusers_arguments(model, pose, face_pixel_values, latent.shape[2])
    saved = model.attn_processors, model.condition_embedder.timesteps_proj, model.patch_embedding
    model.set_attn_processor({name: processor if name.startswith("face_adapter.") else WanAttnProcessor()
                              for name, processor in saved[0].items()})  # Animate's face adapter keeps its own
    model.condition_embedder.timesteps_proj = WanSinusoid(model.config.freq_dim)
    if lead:
        reference = wrap_pad(reference_latent.unsqueeze(2), patch)[:, :, 0]
        model.patch_embedding = ReferenceFirstEmbedding(model, reference.to(device, compute))
    if camera_conditions is not None and getattr(model, "control_adapter", None) is not None:
        model.patch_embedding = CameraAddedEmbedding(model, camera_conditions.to(device, compute))
    hooks = audio_reference_hooks(model, audio_embed.to(device, compute), latent.shape[2]) \
        if humo and audio_embed is not None else no_face_reference(model, animate and face_pixel_values is None)
    try:
        with torch.no_grad(), hooks:
            result = model(hidden_states=latent.to(device, compute), timestep=sigma.to(device),
                           encoder_hidden_states=context.to(device, compute), encoder_hidden_states_image=image,
                           return_dict=False, **extra)[0]
    finally:
        model.set_attn_processor(saved[0])
        model.condition_embedder.timesteps_proj, model.patch_embedding = saved[1:]
    t, h, w = x.shape[2:]
    return result[:, :, lead:lead + t, :h, :w].to(x.dtype).cpu()


def _diffusers_vace_arguments(model, vace_context: torch.Tensor, vace_strength: Optional[list], patch) -> dict:
    if vace_context.shape[1] != 1:
        raise ValueError("diffusers' WanVACETransformer3DModel takes one hint video (vace_context [B, 1, ...])")
    strength = 1.0 if vace_strength is None else float(vace_strength[0])
    device, compute = model.scale_shift_table.device, model.scale_shift_table.dtype
    return {"control_hidden_states": wrap_pad(vace_context[:, 0], patch).to(device, compute),
            "control_hidden_states_scale": torch.full((len(model.config.vace_layers),), strength, device=device)}


class ReferenceFirstEmbedding(torch.nn.Module):
    """For the single-device reference: stands in for patch_embedding on a latent one frame longer than the video,
    giving ref_conv(reference) as frame 0 and patch_embedding of the video after it."""

    def __init__(self, model, reference: torch.Tensor):
        super().__init__()
        self.patch_embedding, self.ref_conv, self.reference = model.patch_embedding, model.ref_conv, reference

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        video = self.patch_embedding(latent[:, :, 1:])
        return torch.cat([self.ref_conv(self.reference.to(video.dtype)).unsqueeze(2), video], dim=2)


class CameraAddedEmbedding(nn.Module):
    """For the single-device reference: patch_embedding with the adapter's output added, as CameraWanModel does."""

    def __init__(self, model, conditions: torch.Tensor):
        super().__init__()
        self.patch_embedding, self.control_adapter, self.conditions = model.patch_embedding, model.control_adapter, \
            conditions

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        return self.patch_embedding(latent) + self.control_adapter(self.conditions.to(latent.dtype))


@contextmanager
def audio_reference_hooks(model, audio_embed: torch.Tensor, frames: int):
    """While open, diffusers' stock blocks add HuMo's audio attention to their text cross-attention output (which
    equals adding it after the cross-attention residual), computed over the whole sequence in ComfyUI's way (tokens
    regrouped per frame; frames beyond the audio's get zero audio). Written apart from HumoAudio."""
    padded = torch.zeros(audio_embed.shape[0], frames, *audio_embed.shape[2:], dtype=audio_embed.dtype,
                         device=audio_embed.device)
    padded[:, :audio_embed.shape[1]] = audio_embed
    with torch.no_grad():
        tokens = model.audio_proj(padded)
    handles = []
    for block in model.blocks:
        seen = {}
        handles.append(block.norm2.register_forward_pre_hook(lambda module, args, seen=seen: seen.update(x=args[0])))
        handles.append(block.attn2.register_forward_hook(
            lambda module, args, out, block=block, seen=seen: out + _whole_sequence_audio(
                block.audio_cross_attn_wrapper, seen["x"] + out, tokens, frames)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _whole_sequence_audio(wrapper, hidden: torch.Tensor, tokens: torch.Tensor, frames: int) -> torch.Tensor:
    attention = wrapper.audio_cross_attn
    batch, length, dim = hidden.shape
    heads = attention.heads
    query = attention.norm_q(attention.q(wrapper.norm1_audio(hidden)))
    key, value = attention.norm_k(attention.k(tokens)), attention.v(tokens)
    query = query.reshape(batch * frames, length // frames, heads, -1).transpose(1, 2)
    key = key.reshape(batch * frames, AUDIO_TOKENS, heads, -1).transpose(1, 2)
    value = value.reshape(batch * frames, AUDIO_TOKENS, heads, -1).transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value)
    return attention.o(out.transpose(1, 2).reshape(batch, length, dim))


def diffusers_arguments(model, pose_latents: Optional[torch.Tensor], face_pixel_values: Optional[torch.Tensor],
                        frames: int) -> dict:
    """diffusers' pose_hidden_states / face_pixel_values for an x of `frames` latent frames. diffusers needs both,
    with exactly frames - 1 pose frames and 4 * (frames - 2) + 1 face frames (so the motion tokens cover every
    frame); without a face video use no_face_reference()."""
    device, compute = model.scale_shift_table.device, model.scale_shift_table.dtype
    if pose_latents is None or pose_latents.shape[2] != frames - 1:
        raise ValueError(f"the diffusers reference of Wan Animate needs pose_latents of {frames - 1} frames")
    face = face_pixel_values
    if face is None:
        face = torch.zeros(pose_latents.shape[0], 3, 1, 1, 1)
    elif face.shape[2] != 4 * (frames - 2) + 1:
        raise ValueError(f"the diffusers reference of Wan Animate needs {4 * (frames - 2) + 1} face frames")
    return {"pose_hidden_states": pose_latents.to(device, compute), "face_pixel_values": face.to(device, compute)}


@contextmanager
def no_face_reference(model, active: bool):
    """While open (when active), the stock forward runs as ComfyUI's without face_pixel_values: the face adapter
    adds nothing (its modules return zeros; the motion encoder is skipped)."""
    if not active:
        yield
        return
    saved = model.motion_encoder, model.face_adapter
    width = model.config.motion_encoder_dim
    model.motion_encoder = _Zeros(lambda images: images.new_zeros(images.shape[0], width))
    model.face_adapter = torch.nn.ModuleList([_Zeros(torch.zeros_like)] * len(saved[1]))
    try:
        yield
    finally:
        model.motion_encoder, model.face_adapter = saved


class _Zeros(torch.nn.Module):
    def __init__(self, make):
        super().__init__()
        self.make = make

    def forward(self, first: torch.Tensor, *_) -> torch.Tensor:
        return self.make(first)


def s2v_reference_forward(model, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
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
