"""MiniMax H3's ComfyUI host description: ComfyUI's MiniMaxH3 model class, and the hooks that turn its call
`diffusion_model([video, audio], timestep, context, minimax_payload=..., denoise_mask=..., audio_denoise_mask=...)`
into the pool's packed call (plan.py) and back: the audio carried on the video's schedule (`audio_scale`) is undone
before and redone after the call as ComfyUI's MiniMaxH3Model.forward does, first / last frames become keyframe
latents and ref2va's reference blocks `references` (both noise-augmented with the payload's seeds, as ComfyUI
augments them), the text encoder's per-token tags go along, the layout is rebuilt by the workers,
and everything else the payload asks for goes to the workers, which refuse it by name."""
from __future__ import annotations

import torch

from ...contract import ComfyHost, HostHooks
from .plan import KEYFRAME_TIMESTEP, SHIFTS, patchify, time_shift_sigma

FULL = 1.0 - 1e-3  # a denoise mask at least this everywhere generates every row (ComfyUI's mask_row_values)


class PackedMiniMax(HostHooks):
    """ComfyUI's MiniMaxH3 call <-> the pool's; rope_options ignored, as ComfyUI's MiniMaxH3Model ignores them."""

    rope_options = "ignored"

    def __init__(self):
        super().__init__()
        self._audio = None  # (scale, carry, audio sigma, carried audio) of the call in flight, for unpack

    def call_inputs(self, transformer_options: dict, inputs: dict) -> dict:
        extra = {name: transformer_options[key] for name, key in
                 (("sample_sigmas", "sample_sigmas"), ("sigma_shift_video", "minimax_h3_sigma_shift_video"),
                  ("sigma_shift_audio", "minimax_h3_sigma_shift_audio")) if transformer_options.get(key) is not None}
        return extra

    def pack(self, x, timestep, inputs: dict) -> tuple:
        if not isinstance(x, (list, tuple)) or len(x) != 2:
            raise ValueError("MiniMax H3 runs audio and video together: give both latents")
        video, audio = x
        inputs = dict(inputs)
        payload = dict(inputs.pop("minimax_payload", None) or {})
        for name in ("denoise_mask", "audio_denoise_mask"):
            mask = inputs.pop(name, None)
            if mask is not None and not bool((mask >= FULL).all()):
                inputs[name] = mask  # the workers refuse it by name
        scale = float(payload.pop("audio_scale", 1.0))
        self._audio = None
        if scale != 1.0:
            shifts = (float(inputs.get("sigma_shift_video") or SHIFTS[0]),
                      float(inputs.get("sigma_shift_audio") or SHIFTS[1]))
            sigma = float((timestep.flatten()[0] / 1000.0).float().clamp(min=1e-6))
            sigma_audio = time_shift_sigma(sigma, *shifts)
            audio = audio * (sigma_audio / sigma)
            self._audio = (scale, sigma_audio, audio)
        inputs.update(keyframe_inputs(payload))
        inputs.update(reference_inputs(payload))
        if payload.get("text_token_tags") is not None:
            inputs["text_token_tags"] = payload["text_token_tags"].reshape(-1).long()
        packed = torch.cat([video.flatten(1), audio.flatten(1)], dim=1).unsqueeze(1)
        inputs["latent_shapes"] = [list(video.shape), list(audio.shape)]
        return packed, timestep, inputs

    def unpack(self, out: torch.Tensor, x) -> list:
        flat = out.reshape(out.shape[0], -1)
        split = x[0][0].numel()
        video, audio = flat[:, :split].reshape(x[0].shape), flat[:, split:].reshape(x[1].shape)
        if self._audio is not None:
            scale, sigma_audio, carried = self._audio
            audio = (1.0 - scale) * carried + (1.0 + (scale - 1.0) * sigma_audio) * audio
        return [video, audio]


def keyframe_inputs(payload: dict) -> dict:
    """fl2va's first / last frames (and the guides of MiniMaxH3AddGuide): the keyframes' latents, noise-augmented in
    patch rows from the payload's seed (every condition restarts the same generator, as ComfyUI's _cond_video_rows),
    at their frame indices."""
    inputs = keyframe_audio_inputs(payload)
    keyframes = [frame for frame in payload.get("keyframes") or () if frame.get("latent") is not None]
    latents = [frame["latent"] for frame in keyframes]
    if not latents:
        return inputs
    strength = float(payload.get("visual_cond_noise_aug", KEYFRAME_TIMESTEP))
    augmented = [augment_video(latent, strength, int(payload.get("seed", 0))) for latent in latents]
    inputs.update(keyframe_latents=augmented, keyframe_frames=[int(frame["resolved_frame_index"]) for frame in keyframes],
                  keyframe_timestep=strength)
    return inputs


def keyframe_audio_inputs(payload: dict) -> dict:
    """MiniMaxH3AddGuide's audio guides: their latents (augmented as ComfyUI's _cond_audio_rows: the seed + 1) at
    their keyframes' frame indices."""
    guides = [frame for frame in payload.get("keyframes") or () if frame.get("audio_latent") is not None]
    if not guides:
        return {}
    strength = float(payload.get("audio_cond_noise_aug", 1.0))
    return {"keyframe_audio_latents": [augment_audio(frame["audio_latent"], strength, int(payload.get("seed", 0)) + 1)
                                       for frame in guides],
            "keyframe_audio_frames": [int(frame["resolved_frame_index"]) for frame in guides],
            "audio_cond_timestep": strength}


def reference_inputs(payload: dict) -> dict:
    """ref2va / omni-ref's reference blocks (the payload's `refs`, ComfyUI's MiniMaxH3ReferenceToVideo) as the pool's
    `references`: each block's kind and its video / audio latents, noise-augmented as ComfyUI's _cond_video_rows /
    _cond_audio_rows do (the video seed, the audio seed + 1, every latent restarting its generator)."""
    refs = list(payload.get("refs") or ())
    if not refs:
        return {}
    seed = int(payload.get("seed", 0))
    video_strength = float(payload.get("visual_cond_noise_aug", KEYFRAME_TIMESTEP))
    audio_strength = float(payload.get("audio_cond_noise_aug", 1.0))
    references = []
    for ref in refs:
        block = {"kind": ref.get("kind")}
        if ref.get("latent") is not None:
            block["latent"] = augment_video(ref["latent"], video_strength, seed)
        if ref.get("audio_latent") is not None:
            block["audio"] = augment_audio(ref["audio_latent"], audio_strength, seed + 1)
        references.append(block)
    return {"references": references, "keyframe_timestep": video_strength, "audio_cond_timestep": audio_strength}


def augment_video(latent: torch.Tensor, strength: float, seed: int) -> torch.Tensor:
    """a x + (1 - a) noise, the noise drawn in ComfyUI's patch-row order [t*(H/2)*(W/2), C*4]."""
    latent = latent.float()
    if strength >= 1.0:
        return latent
    noise = torch.randn(patchify(latent)[0].shape, generator=torch.Generator("cpu").manual_seed(seed))
    return strength * latent + (1.0 - strength) * unpatchify_like(noise.to(latent.device), latent)


def augment_audio(latent: torch.Tensor, strength: float, seed: int) -> torch.Tensor:
    """The same for a stereo audio latent [1, A, 2, t], the noise in channel-major rows [2*t, A]."""
    latent = latent.float()
    if strength >= 1.0:
        return latent
    _, channels, stereo, steps = latent.shape
    noise = torch.randn(stereo * steps, channels, generator=torch.Generator("cpu").manual_seed(seed))
    rows = noise.reshape(stereo, steps, channels).permute(2, 0, 1).unsqueeze(0)
    return strength * latent + (1.0 - strength) * rows.to(latent.device)


def unpatchify_like(rows: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
    """patchify's inverse for one item: rows [t*(H/2)*(W/2), C*4] -> [1, C, t, H, W]."""
    _, channels, frames, height, width = latent.shape
    grid = rows.reshape(1, frames, height // 2, width // 2, channels, 2, 2).permute(0, 4, 1, 2, 5, 3, 6)
    return grid.reshape(latent.shape)


COMFY = ComfyHost(model_classes={"": "MiniMaxH3"}, unet_config=lambda info: {"image_model": "minimax_h3"},
                  hooks=PackedMiniMax())
