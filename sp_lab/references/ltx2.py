"""LTX-2, 2.3 and 2.5's single-device reference (tests, demos): diffusers' stock LTX2VideoTransformer3DModel forward
with ComfyUI's choices hooked in (comfy_hooks), its own connector forward for the prompt. Written apart from the
sequence-parallel plan (sp_runtime.families.ltx2) on purpose; it shares only the position and prompt-input helpers.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from sp_runtime.families.ltx2.detection import CONNECTORS
from sp_runtime.families.ltx2.plan import DEFAULT_FRAME_RATE, comfy_video_coords, prompt_sigma
from sp_runtime.families.ltx2.text import CONNECTOR_MIN_TOKENS, connector_inputs


def reference_forward(model, video: torch.Tensor, audio: torch.Tensor, timestep: torch.Tensor,
                      context: torch.Tensor, audio_timestep: Optional[torch.Tensor] = None,
                      frame_rate: float = DEFAULT_FRAME_RATE, comfy: bool = True,
                      keyframe_idxs: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' LTX2VideoTransformer3DModel.forward on the whole sequence, given ComfyUI's video token times
    (comfy_video_coords, with guide tokens' keyframe_idxs), the prompt through diffusers' own connector forward
    (padding replaced by registers), LTX-2.5's keyframe marker on the first latent frame's tokens (diffusers'
    video_keyframes_mask) and (comfy=True) ComfyUI's gates and video-to-audio norm hooked in (comfy_hooks): (video
    velocity [B, C, F, H, W], audio [B, C, T, M]). For files with use_middle_indices_grid (diffusers' rope always
    takes token middles)."""
    batch, channels, frames, height, width = video.shape
    texts = reference_prompts(model, context)
    scale = model.config.timestep_scale_multiplier
    sigma = timestep.reshape(batch, -1) * scale
    audio_sigma = sigma if audio_timestep is None else audio_timestep.reshape(batch, -1) * scale
    coords = comfy_video_coords(model, batch, (frames, height, width), frame_rate, video.device, keyframe_idxs)
    prompt_sigmas = {"sigma": prompt_sigma(sigma), "audio_sigma": prompt_sigma(audio_sigma)}  # LTX-2.3's prompt AdaLN
    guides = 0 if keyframe_idxs is None else keyframe_idxs.shape[2]
    not_guide = torch.arange(coords.shape[2], device=coords.device) < coords.shape[2] - guides
    first_frame = (coords[:, 0, :, 0] == 0) & not_guide
    with torch.no_grad(), (comfy_hooks(model, sigma, audio_sigma) if comfy else contextlib.nullcontext()):
        out, audio_out = model(hidden_states=video.flatten(2).transpose(1, 2),
                               audio_hidden_states=audio.transpose(1, 2).flatten(2), encoder_hidden_states=texts[0],
                               audio_encoder_hidden_states=texts[1], timestep=sigma, audio_timestep=audio_sigma,
                               video_coords=coords, audio_num_frames=audio.shape[2], return_dict=False,
                               video_keyframes_mask=first_frame.unsqueeze(-1), **prompt_sigmas)
    video_out = out.transpose(1, 2).reshape(batch, -1, frames, height, width)
    audio_out = audio_out.unflatten(2, (audio.shape[1], audio.shape[3])).transpose(1, 2)
    return video_out, audio_out


def reference_prompts(model, context: torch.Tensor) -> list[torch.Tensor]:
    """The video and audio prompts through diffusers' own connector forward: the prompt padded to whole register
    tiles of at least 1024 tokens, the padding masked (diffusers swaps it for registers)."""
    batch, texts = context.shape[0], []
    for name, prompt in zip(CONNECTORS, connector_inputs(model, context)):
        connector = getattr(model, name)
        count = connector.learnable_registers.shape[0]
        length = -(-max(CONNECTOR_MIN_TOKENS, prompt.shape[1]) // count) * count
        padded = torch.cat([prompt, prompt.new_zeros(batch, length - prompt.shape[1], prompt.shape[2])], dim=1)
        keep = torch.arange(length) < prompt.shape[1]
        mask = torch.where(keep, 0.0, -1e4).expand(batch, length)[:, None, None, :]
        with torch.no_grad():
            texts.append(connector(padded, mask)[0])
    return texts


@contextlib.contextmanager
def comfy_hooks(model, video_timestep: torch.Tensor, audio_timestep: torch.Tensor):
    """While open, diffusers' stock forward computes what ComfyUI's LTXAVModel does (LTX-2, 2.3, 2.5): the
    audio-to-video gate embeds the audio's largest timestep of the call and the video-to-audio gate the video's
    (diffusers: each stream's own), and each block's video-to-audio attention reads the video normalised after the
    audio-to-video residual (the block's normalised video is rewritten in place once that residual is known).
    Written apart from the pool's forward."""
    factor = model.config.cross_attn_timestep_scale_multiplier / model.config.timestep_scale_multiplier
    gates = {}

    def gate_hook(name, timestep):
        def hook(module, args, kwargs, out):
            replaced = module.forward(timestep.max().expand_as(args[0]) * factor, **kwargs)
            gates[name] = replaced[0].view(kwargs["batch_size"], -1, replaced[0].shape[-1])
            return replaced
        return hook

    handles = [model.av_cross_attn_video_a2v_gate.register_forward_hook(gate_hook("a2v", audio_timestep),
                                                                        with_kwargs=True),
               model.av_cross_attn_audio_v2a_gate.register_forward_hook(gate_hook("v2a", video_timestep),
                                                                        with_kwargs=True)]
    for block in model.transformer_blocks:
        seen = {}
        norm = block.audio_to_video_norm
        handles.append(norm.register_forward_hook(lambda module, args, out, seen=seen: seen.update(x=args[0], n=out)))
        handles.append(block.audio_to_video_attn.register_forward_hook(
            lambda module, args, out, block=block, seen=seen: _renormalise_after_a2v(block, seen, gates["a2v"], out)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _renormalise_after_a2v(block, seen: dict, gate_embedding: torch.Tensor, a2v: torch.Tensor) -> None:
    table = block.video_a2v_cross_attn_scale_shift_table[4:]
    gate = block.get_mod_params(table, gate_embedding, a2v.shape[0])[0].squeeze(2)
    seen["n"].copy_(block.audio_to_video_norm.forward(seen["x"] + gate * a2v))
