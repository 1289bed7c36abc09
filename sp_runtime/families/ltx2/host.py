"""LTX-2's ComfyUI host description: ComfyUI's LTXAV model class and what it reads from `diffusion_model`, and the
host hooks that turn its call `diffusion_model([video, audio], (video sigma, audio sigma), context, ...)` into the
pool's packed call and back (the packed call is described in plan.py)."""
from __future__ import annotations

from typing import Optional

import torch

from ...contract import ComfyHost, HostHooks, ModelInfo

VAE_SCALE_FACTORS = (8, 32, 32)
PATCHIFIERS = "comfy.ldm.lightricks.symmetric_patchifier"
# inputs of ComfyUI's LTXAV call the host handles itself (the timesteps already carry the denoise masks; the guide
# attention entries become the input guide_weights, guide_weights())
HOST_ONLY_INPUTS = ("denoise_mask", "audio_denoise_mask", "guide_attention_entries")
UNSUPPORTED_INPUTS = ("ref_audio", "generated_keyframes")


def comfy_attributes(info: ModelInfo) -> dict:
    """What ComfyUI's LTXAV class (and LTX nodes) read from diffusion_model; the prompt passes through unchanged
    (the workers run the connectors, which hold weights)."""
    config = info.config
    return {"patch_size": 1, "vae_scale_factors": VAE_SCALE_FACTORS,
            "causal_temporal_positioning": config["causal_temporal_positioning"],
            "preprocess_text_embeds": lambda context, unprocessed=False: context,
            "inner_dim": config["num_attention_heads"] * config["attention_head_dim"],
            "audio_inner_dim": config["audio_num_attention_heads"] * config["audio_attention_head_dim"],
            "cross_attention_dim": config["cross_attention_dim"],
            "audio_cross_attention_dim": config["audio_cross_attention_dim"],
            "caption_channels": config["caption_channels"],
            "caption_proj_before_connector": not config["use_prompt_embeddings"],
            "caption_projection_first_linear": False}


class PackedAudioVideo(HostHooks):
    """ComfyUI's LTXAV call <-> the pool's: both latents packed into one x, both sigmas and the gate sigmas as
    inputs; rope_options ignored, as ComfyUI's LTXAV does; its stream switches refused unless they run every
    stream."""

    rope_options = "ignored"
    refused_options = {key: (True, "an LTX-2 stream switch: the workers run every stream in full")
                       for key in ("run_vx", "run_ax", "a2v_cross_attn", "v2a_cross_attn")}

    def pack(self, x, timestep, inputs: dict) -> tuple:
        """ComfyUI's LTXAV call ([video, audio], (video sigma, audio sigma), ...) -> the pool's, with the gate sigmas
        ComfyUI takes (each stream's largest over the whole call) and the video sigma per frame where ComfyUI reads
        it so (comfy_video_sigma)."""
        if not isinstance(x, (list, tuple)) or len(x) != 2 or x[1].numel() == 0:
            raise ValueError("LTX-2 runs audio and video together: give both latents (an empty-audio latent for "
                             "video-only generation is not supported under sequence parallelism yet)")
        unsupported = sorted(name for name in UNSUPPORTED_INPUTS if inputs.get(name) is not None)
        if unsupported:
            raise ValueError(f"LTX-2 inputs {unsupported} (reference-audio / generated-keyframe conditioning) are "
                             f"not supported under sequence parallelism yet")
        check_guides(inputs)
        video, audio = x
        weights = guide_weights(inputs.get("guide_attention_entries"), video.shape[0])
        packed = torch.cat([video.flatten(1), audio.flatten(1)], dim=1).unsqueeze(1)
        video_sigma, audio_sigma = timestep if isinstance(timestep, (list, tuple)) else (timestep, timestep)
        gates = {"a2v_gate_sigma": audio_sigma.max(), "v2a_gate_sigma": video_sigma.max()}
        video_sigma = comfy_video_sigma(video_sigma, video.shape, inputs.get("denoise_mask"))
        inputs = {key: value for key, value in inputs.items() if key not in HOST_ONLY_INPUTS}
        inputs.update(latent_shapes=[list(video.shape), list(audio.shape)], audio_timestep=audio_sigma, **gates)
        if weights is not None:
            inputs["guide_weights"] = weights
        return packed, video_sigma, inputs

    def unpack(self, out: torch.Tensor, x) -> list:
        """The pool's packed output -> [video velocity, audio velocity] shaped like ComfyUI's x."""
        flat = out.reshape(out.shape[0], -1)
        split = x[0][0].numel()
        return [flat[:, :split].reshape(x[0].shape), flat[:, split:].reshape(x[1].shape)]


def check_guides(inputs: dict) -> None:
    """Guides (LTXVAddGuide) that ComfyUI runs as extra video tokens at keyframe_idxs' positions work, at any strength
    and with an attention mask (guide_weights); refused with a clear error: the token filter of guides dilated for
    IC-LoRAs with reference_downscale_factor > 1 (negative denoise mask)."""
    mask = inputs.get("denoise_mask")
    if inputs.get("keyframe_idxs") is not None and mask is not None and bool((mask < 0).any()):
        raise ValueError("LTX-2 guides dilated for an IC-LoRA with reference_downscale_factor > 1 (negative denoise "
                         "mask) are not supported under sequence parallelism yet; use a LoRA with factor 1")


def guide_weights(entries, batch: int) -> Optional[torch.Tensor]:
    """LTXVAddGuide's guide attention entries -> the weights of the guide tokens [batch, W], the same for every item
    (ComfyUI's mask is one for the batch), or None when ComfyUI builds no mask (every strength 1, no pixel mask).
    Each guide gives its strength per token, or with a pixel mask (LTXVAddGuide's attention_mask) the mask's
    per-token means (latent_mask_weights, batch item 0) x strength for at most its tokens; they follow each other
    from the first guide token on, as ComfyUI concatenates them."""
    entries = [entry for entry in entries or () if int(entry["pre_filter_count"]) > 0]
    if not any(float(entry["strength"]) != 1.0 or entry.get("pixel_mask") is not None for entry in entries):
        return None
    weights = []
    for entry in entries:
        count, strength = int(entry["pre_filter_count"]), float(entry["strength"])
        pixel_mask, shape = entry.get("pixel_mask"), entry.get("latent_shape")
        if pixel_mask is not None and shape is not None:
            weights.append(latent_mask_weights(pixel_mask.float(), *shape)[0, :count] * strength)
        else:
            weights.append(torch.full((count,), strength))
    weights = torch.cat(weights)
    if bool((weights == 1.0).all()):
        return None
    return weights.expand(batch, -1).contiguous()


def latent_mask_weights(mask: torch.Tensor, frames: int, rows: int, cols: int) -> torch.Tensor:
    """A pixel mask [B, 1, F, H, W] in [0, 1] -> per latent token weights [B, frames x rows x cols], as ComfyUI's LTXV
    model reduces a guide's attention_mask: area means per frame to the latent size, then in time the first pixel
    frame for the first latent frame and the means of equal groups of the others (trailing frames that fill no
    group dropped; too few frames: nearest frame; one pixel frame: repeated)."""
    batch, _, pixel_frames = mask.shape[:3]
    spatial = torch.nn.functional.interpolate(mask.transpose(1, 2).reshape(batch * pixel_frames, 1, *mask.shape[3:]),
                                              size=(rows, cols), mode="area")
    spatial = spatial.reshape(batch, pixel_frames, 1, rows, cols).transpose(1, 2)
    first = spatial[:, :, :1]
    if pixel_frames > 1 and frames > 1:
        group = (pixel_frames - 1) // (frames - 1)
        if group < 1:
            rest = spatial[:, 0, 1:].permute(0, 2, 3, 1).reshape(batch * rows * cols, 1, pixel_frames - 1)
            rest = torch.nn.functional.interpolate(rest, size=frames - 1, mode="nearest")
            rest = rest.reshape(batch, rows, cols, frames - 1).permute(0, 3, 1, 2).unsqueeze(1)
        else:
            rest = spatial[:, :, 1:1 + (frames - 1) * group].reshape(batch, 1, frames - 1, group, rows, cols).mean(3)
        latent = torch.cat([first, rest], dim=2)
    elif frames > 1:
        latent = first.expand(-1, -1, frames, -1, -1)
    else:
        latent = first
    return latent.reshape(batch, -1)


def comfy_video_sigma(sigma: torch.Tensor, shape, denoise_mask) -> torch.Tensor:
    """ComfyUI's LTXAV reads a per-token video sigma once per latent frame (the frame's first token) unless batch
    item 0's denoise mask varies within a frame (its CompressedTimestep): the same sigmas, per token."""
    per_frame = shape[3] * shape[4]
    if sigma.dim() < 2 or sigma[0].numel() != shape[2] * per_frame:
        return sigma
    if denoise_mask is not None and any(frame.numel() and frame.min() != frame.max() for frame in denoise_mask[0, 0]):
        return sigma
    frames = sigma.reshape(sigma.shape[0], shape[2], per_frame)[:, :, :1]
    return frames.expand(-1, -1, per_frame).reshape(sigma.shape)


COMFY = ComfyHost(model_classes={"": "LTXAV"}, unet_config=lambda info: {"image_model": "ltxav"},
                  attributes=comfy_attributes,
                  helpers={"patchifier": (PATCHIFIERS, "SymmetricPatchifier", (1,), {"start_end": True}),
                           "a_patchifier": (PATCHIFIERS, "AudioPatchifier", (1,), {"start_end": True})},
                  hooks=PackedAudioVideo())
