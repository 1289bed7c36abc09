"""LTX-2, 2.3 and 2.5 (audio + video) under Ulysses SP: loading into diffusers' LTX2VideoTransformer3DModel (plus the
two text connectors ComfyUI keeps in the diffusion model) and the pool call for ComfyUI's LTXAV model.

It computes what ComfyUI's own LTXAVModel (comfy/ldm/lightricks/av_model.py) computes, which differs from
diffusers' forward in a few places (all on diffusers' modules here): the audio-to-video attention is gated by the
audio's largest sigma of the call and the video-to-audio attention by the video's (diffusers: each stream's own
sigma); the video-to-audio attention reads the video normalised after the audio-to-video residual (diffusers:
before); video times are frame index x (1 / frame_rate); q / k norms use eps 1e-5; token positions follow the file's
use_middle_indices_grid / causal_temporal_positioning.

Pool call (what the host's proxy makes of ComfyUI's `diffusion_model([vx, ax], (v_t, a_t), context, frame_rate)`):
x [B, 1, N] is the video latent [B, 128, F, H, W] and the audio latent [B, 8, T, 16] flattened per item and
concatenated (input `latent_shapes` gives both shapes); timestep the video sigma [B] or per video token [B, Nv];
`audio_timestep` the audio sigma [B] or [B, T] (default: the video's); context the text encoder output
[B, L, caption_channels] (the connectors run here) or the connectors' output [B, L', 2 x caption_channels]; for
LTX-2.3 / 2.5 (no caption projection in the model) the text encoder's video and audio features side by side
[B, L, cross_attention_dim + audio_cross_attention_dim], which the connectors always process (ComfyUI's 2.3 / 2.5
text encoders mark their output unprocessed); `frame_rate` (default 25); `a2v_gate_sigma` / `v2a_gate_sigma` the
sigmas of the two cross-modal gates (default: the largest audio / video sigma of the call; the host passes
ComfyUI's, taken over the whole batch, so CFG halves gate alike); `keyframe_idxs` [B, 3, G, 2] the pixel bounds of
the last G video tokens, guide frames appended to the video latent (LTXVAddGuide; their sigmas, from the denoise mask,
are in the per-token timestep). The output is packed like x: the video and audio velocities (guide frames included,
which ComfyUI's LTXVCropGuides drops).

SP plan: video tokens are split over the sequence group (balanced shards); every rank patch-embeds, modulates and
writes only its own (guide tokens are video tokens: their positions are sliced with them). Audio tokens are few
(25 per second against thousands of video tokens per frame), so every rank holds all of them: splitting them would cost an exchange per attention for almost no compute. Video self-attention
goes through sp_attention (Ulysses / Ring); text cross-attention, audio self-attention and audio-to-video attention
(video queries, audio keys) are local; video-to-audio attention (audio queries over the split video keys) merges the
ranks' partial results by log-sum-exp (attention_over_key_shards), so the audio stays the same on every rank. Any
audio-token count (also fewer than the ranks) works; rank 0 of each sequence group writes the audio output.
LTX-2.3 / 2.5 add nothing that crosses tokens: the attention gates are per query token and head, the prompt
modulation per item (ComfyUI's prompt timestep is the item's largest sigma over all its tokens, which every rank
holds), LTX-2.5's keyframe marker per token (the first latent frame's), so they apply to each rank's own tokens as on
one device.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

from ..attention import SeqShards, attention_over_key_shards, sp_attention
from ..contract import ComfyHost, Detection, LoadRequest, ModelInfo
from ..checkpoints.loading import (KeyPlan, ProgressFn, WeightDtypes, build_empty_model, choose_dtypes,
                                   detected_checkpoint, load_weights, strip_prefix)
from .ltx2_checkpoint import CONNECTORS, FAMILY, detect, ltx2_key_plan
from ..sp.video_tokens import VideoGrid

DESCRIPTION = "LTX-2, 2.3 and 2.5 (audio + video)"
CONNECTOR_ROPE_MAX_POS = 4096   # ComfyUI's Embeddings1DConnector positions: index / 4096
CONNECTOR_MIN_TOKENS = 1024     # ComfyUI pads the prompt with learnable registers to at least this many tokens
DEFAULT_FRAME_RATE = 25.0       # ComfyUI's LTXAV default frame_rate
QK_NORM_EPS = 1e-5              # ComfyUI's CrossAttention q_norm / k_norm (diffusers' LTX2Attention: 1e-6)
UNIT = (1, 1, 1)                # LTX-2 takes its latents unpatched: one token per latent pixel


VAE_SCALE_FACTORS = (8, 32, 32)
PATCHIFIERS = "comfy.ldm.lightricks.symmetric_patchifier"
# inputs of ComfyUI's LTXAV call the host handles itself (the timesteps already carry the denoise masks; the guide
# attention entries are checked to ask for no attention mask, check_guides)
HOST_ONLY_INPUTS = ("denoise_mask", "audio_denoise_mask", "guide_attention_entries")
UNSUPPORTED_INPUTS = ("ref_audio", "generated_keyframes")


def _comfy_attributes(info: ModelInfo) -> dict:
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


def pack_comfy_call(x, timestep, inputs: dict) -> tuple:
    """ComfyUI's LTXAV call ([video, audio], (video sigma, audio sigma), ...) -> the pool's (module docstring), with
    the gate sigmas ComfyUI takes (each stream's largest over the whole call) and the video sigma per frame where
    ComfyUI reads it so (comfy_video_sigma)."""
    if not isinstance(x, (list, tuple)) or len(x) != 2 or x[1].numel() == 0:
        raise ValueError("LTX-2 runs audio and video together: give both latents (an empty-audio latent for "
                         "video-only generation is not supported under sequence parallelism yet)")
    unsupported = sorted(name for name in UNSUPPORTED_INPUTS if inputs.get(name) is not None)
    if unsupported:
        raise ValueError(f"LTX-2 inputs {unsupported} (reference-audio / generated-keyframe conditioning) are not "
                         f"supported under sequence parallelism yet")
    check_guides(inputs)
    video, audio = x
    packed = torch.cat([video.flatten(1), audio.flatten(1)], dim=1).unsqueeze(1)
    video_sigma, audio_sigma = timestep if isinstance(timestep, (list, tuple)) else (timestep, timestep)
    gates = {"a2v_gate_sigma": audio_sigma.max(), "v2a_gate_sigma": video_sigma.max()}
    video_sigma = comfy_video_sigma(video_sigma, video.shape, inputs.get("denoise_mask"))
    inputs = {key: value for key, value in inputs.items() if key not in HOST_ONLY_INPUTS}
    inputs.update(latent_shapes=[list(video.shape), list(audio.shape)], audio_timestep=audio_sigma, **gates)
    return packed, video_sigma, inputs


def check_guides(inputs: dict) -> None:
    """Guides (LTXVAddGuide) that ComfyUI runs as extra video tokens at keyframe_idxs' positions work; refused with a
    clear error: the per-guide attention mask ComfyUI builds for a guide strength other than 1 or a guide attention
    mask, and the token filter of guides dilated for IC-LoRAs with reference_downscale_factor > 1 (negative denoise
    mask)."""
    attenuated = [entry for entry in inputs.get("guide_attention_entries") or ()
                  if entry["strength"] != 1.0 or entry.get("pixel_mask") is not None]
    if attenuated:
        strengths = [float(entry["strength"]) for entry in attenuated]
        raise ValueError(f"LTX-2 guides with a strength other than 1.0 or an attention_mask (LTXVAddGuide strength "
                         f"{strengths}) need a per-guide attention mask, which is not supported under sequence "
                         f"parallelism yet; guides with strength 1.0 and no attention_mask work")
    mask = inputs.get("denoise_mask")
    if inputs.get("keyframe_idxs") is not None and mask is not None and bool((mask < 0).any()):
        raise ValueError("LTX-2 guides dilated for an IC-LoRA with reference_downscale_factor > 1 (negative "
                         "denoise mask) are not supported under sequence parallelism yet; use a LoRA with factor 1")


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


def unpack_comfy_output(out: torch.Tensor, x) -> list:
    """The pool's packed output -> [video velocity, audio velocity] shaped like ComfyUI's x."""
    flat = out.reshape(out.shape[0], -1)
    split = x[0][0].numel()
    return [flat[:, :split].reshape(x[0].shape), flat[:, split:].reshape(x[1].shape)]


COMFY = ComfyHost(model_classes={"": "LTXAV"}, unet_config=lambda info: {"image_model": "ltxav"},
                  attributes=_comfy_attributes,
                  helpers={"patchifier": (PATCHIFIERS, "SymmetricPatchifier", (1,), {"start_end": True}),
                           "a_patchifier": (PATCHIFIERS, "AudioPatchifier", (1,), {"start_end": True})},
                  pack_call=pack_comfy_call, unpack_output=unpack_comfy_output)


# ---------------------------------------------------------------------------------------------------------------
# Loading

def weight_plan(detection: Detection, keys: Iterable[str]) -> KeyPlan:
    return ltx2_key_plan(keys)


def attach_connectors(model, connectors: dict, theta: float) -> None:
    """The video and audio text connectors (ComfyUI's Embeddings1DConnector = diffusers' LTX2ConnectorTransformer1d)
    as submodules `video_embeddings_connector` / `audio_embeddings_connector` of the transformer; `connectors`
    holds each one's sizes by that name."""
    from diffusers.pipelines.ltx2.connectors import LTX2ConnectorTransformer1d
    for name in CONNECTORS:
        sizes = connectors[name]
        setattr(model, name, LTX2ConnectorTransformer1d(
            num_attention_heads=sizes["num_attention_heads"], attention_head_dim=sizes["attention_head_dim"],
            num_layers=sizes["num_layers"], num_learnable_registers=sizes["num_learnable_registers"],
            rope_base_seq_len=CONNECTOR_ROPE_MAX_POS, rope_theta=theta, rope_double_precision=True,
            rope_type=sizes["rope_type"], gated_attention=sizes["gated_attention"]))


def use_comfy_time_origin(model, causal: bool) -> None:
    """Video frame times as ComfyUI places them: with the file's causal_temporal_positioning the first latent frame
    (one pixel frame) starts at 0 and the others 7 pixel frames earlier than index x 8, as diffusers' rope does with
    causal_offset 1; without it at index x 8 (an offset of the temporal VAE factor cancels diffusers' shift)."""
    model.rope.causal_offset = 1 if causal else model.rope.scale_factors[0]


def use_comfy_qk_norm_eps(model) -> None:
    """ComfyUI's q / k RMS norms (eps 1e-5) in every attention of the transformer and the connectors."""
    from diffusers.models.transformers.transformer_ltx2 import LTX2Attention
    for module in model.modules():
        if isinstance(module, LTX2Attention):
            module.norm_q.eps = module.norm_k.eps = QK_NORM_EPS


def load_model(path: str, dtype: str = "default", device: torch.device | str = "cpu",
               detection: Optional[Detection] = None, options: Optional[dict] = None,
               progress: Optional[ProgressFn] = None, header=None):
    """diffusers' LTX-2 transformer with its connectors and the checkpoint's weights: (model, detection, dtypes)."""
    from accelerate import init_empty_weights
    from diffusers import LTX2VideoTransformer3DModel
    header, detection = detected_checkpoint(path, header, detection, detect, FAMILY, "LTX-2")
    config = {key: value for key, value in detection.config.items() if key not in ("connector", "positions")}
    dtypes = choose_dtypes(dtype, header, detection.prefix)
    model = build_empty_model(LTX2VideoTransformer3DModel, config, dtypes)
    with init_empty_weights():
        attach_connectors(model, detection.config["connector"], config["rope_theta"])
    use_comfy_qk_norm_eps(model)
    use_comfy_time_origin(model, detection.config["positions"]["causal_temporal_positioning"])
    plan = weight_plan(detection, strip_prefix(header.tensors, detection.prefix))
    load_weights(model, header.source, device=device, dtypes=dtypes, prefix=detection.prefix, plan=plan,
                 progress=progress)
    return model, detection, dtypes


def load(request: LoadRequest, detection: Detection, device: torch.device, groups, progress: ProgressFn
         ) -> "LTX2Worker":
    model, detection, dtypes = load_model(request.path, request.dtype, device, detection, request.options, progress,
                                          request.header)
    return LTX2Worker(model, detection, dtypes)


def model_info(model, detection: Detection, dtypes: WeightDtypes) -> ModelInfo:
    config = model.config
    keys = ("in_channels", "audio_in_channels", "num_attention_heads", "attention_head_dim",
            "audio_num_attention_heads", "audio_attention_head_dim", "num_layers", "caption_channels",
            "cross_attention_dim", "audio_cross_attention_dim", "use_prompt_embeddings")
    entries = {key: config[key] for key in keys}
    return ModelInfo(family=FAMILY, variant=detection.variant, in_channels=1, out_channels=1, x_ndim=3,
                     config={**entries, **detection.config["positions"],
                             "unbatched_inputs": ["latent_shapes", "frame_rate"]},
                     weight_dtype=dtypes.storage_name, compute_dtype=dtypes.compute_name)


# ---------------------------------------------------------------------------------------------------------------
# The pool call: packed latents, text, timesteps

@dataclass
class Latents:
    """The packed x split into the video latent [B, C, F, H, W] and the audio latent [B, C, T, M] (views)."""

    video: torch.Tensor
    audio: torch.Tensor

    @classmethod
    def unpack(cls, packed: torch.Tensor, shapes) -> "Latents":
        video_shape, audio_shape = (tuple(int(size) for size in shape) for shape in shapes)
        batch = packed.shape[0]
        flat = packed.reshape(batch, -1)
        split = math.prod(video_shape[1:])
        return cls(flat[:, :split].view(batch, *video_shape[1:]), flat[:, split:].view(batch, *audio_shape[1:]))


def check_call(config, x: torch.Tensor, inputs: dict) -> tuple:
    """The latent shapes of a call, checked against x and the model; clear errors for what LTX-2 cannot take."""
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
    return video, audio


def connect_text(model, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The text encoder output -> the video and audio prompts after the connectors, as ComfyUI's
    preprocess_text_embeds (prompt extended with learnable registers to whole register tiles of at least 1024
    tokens); an LTX-2.0 context already processed ([B, L, 2C]) is split."""
    channels = model.config.caption_channels
    if model.config.use_prompt_embeddings and context.dim() == 3 and context.shape[-1] == 2 * channels:
        return context[..., :channels], context[..., channels:]
    return tuple(_run_connector(getattr(model, name), part) for name, part in zip(CONNECTORS,
                                                                                 connector_inputs(model, context)))


def connector_inputs(model, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The text encoder output -> what the video and the audio connector take: the same [B, L, C] for LTX-2.0, the
    video and audio features of [B, L, video + audio width] for 2.3 / 2.5."""
    config = model.config
    if config.use_prompt_embeddings:
        widths, what = (config.caption_channels,), "the text encoder output"
    else:
        widths, what = (config.cross_attention_dim, config.audio_cross_attention_dim), "video and audio features"
    if context.dim() != 3 or context.shape[-1] != sum(widths):
        processed = f" or [B, L, {2 * widths[0]}] (after the connectors)" if len(widths) == 1 else ""
        raise ValueError(f"LTX-2 needs context [B, L, {sum(widths)}] ({what}){processed}; got "
                         f"{list(context.shape)}")
    if len(widths) == 1:
        return context, context
    return context[..., :widths[0]], context[..., widths[0]:]


def _run_connector(connector, context: torch.Tensor) -> torch.Tensor:
    registers = connector.learnable_registers
    count = registers.shape[0]
    length = -(-max(CONNECTOR_MIN_TOKENS, context.shape[1]) // count) * count
    tiled = registers.to(context.dtype).repeat(length // count, 1)[context.shape[1]:]
    hidden = torch.cat([context, tiled.unsqueeze(0).expand(context.shape[0], -1, -1)], dim=1)
    rotary = connector.rope(hidden.shape[0], hidden.shape[1], device=hidden.device)
    for block in connector.transformer_blocks:
        hidden = block(hidden, attention_mask=None, rotary_emb=rotary)
    return connector.norm_out(hidden)


def _per_token(timestep: torch.Tensor, batch: int, tokens: int, what: str) -> torch.Tensor:
    """A sigma [B] or per token [B, N] (or [B, N, 1]) -> [B, 1] or [B, N]."""
    timestep = timestep.reshape(batch, -1) if timestep.dim() > 1 else timestep.reshape(batch, 1)
    if timestep.shape[1] not in (1, tokens):
        raise ValueError(f"{what} has {timestep.shape[1]} entries per item; give one, or one per {what[:5]} token "
                         f"({tokens})")
    return timestep


# ---------------------------------------------------------------------------------------------------------------
# Sequence-parallel forward

@dataclass
class Stream:
    """One modality on this rank: its tokens, modulations, rotary embeddings and prompt."""

    hidden: torch.Tensor         # [B, n, dim]
    temb: torch.Tensor           # [B, 1 or n, 6 dim] block modulation
    embedded: torch.Tensor       # [B, 1 or n, dim] output modulation
    cross_scale_shift: torch.Tensor
    cross_gate: torch.Tensor
    rope: tuple                  # self-attention rotary (cos, sin) of these tokens
    cross_rope: tuple            # audio <-> video attention rotary of these tokens
    text: torch.Tensor           # [B, L', dim] projected prompt
    prompt_temb: Optional[torch.Tensor] = None  # [B, 1, 2 dim] prompt AdaLN (LTX-2.3); None: its static table


class LTX2Worker:
    """A loaded LTX-2 in one worker; forward() is the pool call described in the module docstring."""

    def __init__(self, model, detection: Detection, dtypes: WeightDtypes):
        self.model = model
        self.dtypes = dtypes
        self.info = model_info(model, detection, dtypes)
        self.middle = detection.config["positions"]["use_middle_indices_grid"]

    def forward(self, x: torch.Tensor, timestep: torch.Tensor, inputs: dict[str, Any], out: torch.Tensor,
                ctx) -> None:
        model, seq, dtype = self.model, ctx.groups.seq, self.dtypes.compute
        video_shape, audio_shape = check_call(model.config, x, inputs)
        latents = Latents.unpack(ctx.to_device("x", x, torch.float32), (video_shape, audio_shape))
        grid = VideoGrid.of(tuple(video_shape[2:]), UNIT)
        shards = SeqShards.balanced(grid.count, seq.degree)
        lo, hi = shards.range(seq.rank)
        context = ctx.to_device("context", inputs["context"], dtype)
        video, audio = _prepare_streams(model, latents, grid, (lo, hi), context, timestep, inputs, ctx, dtype,
                                        self.middle)
        for block in model.transformer_blocks:
            ctx.check_cancel()
            video.hidden, audio.hidden = _block(block, video, audio, seq, shards)
        outputs = Latents.unpack(out, (video_shape, audio_shape))
        grid.write(outputs.video, _head(model, video, "").to(out.dtype).cpu(), lo)
        if seq.rank == 0:
            tokens = _head(model, audio, "audio_").to(out.dtype).cpu()
            outputs.audio.copy_(tokens.unflatten(2, (audio_shape[1], audio_shape[3])).transpose(1, 2))


def _prepare_streams(model, latents: Latents, grid: VideoGrid, token_range: tuple[int, int], context, timestep,
                     inputs, ctx, dtype, middle: bool) -> tuple[Stream, Stream]:
    config = model.config
    batch, device = latents.video.shape[0], ctx.device
    lo, hi = token_range
    audio_frames = latents.audio.shape[2]
    full_sigma = _per_token(ctx.to_device("timestep", timestep, torch.float32), batch, grid.count, "video timestep")
    sigma = full_sigma[:, lo:hi] if full_sigma.shape[1] > 1 else full_sigma
    audio_sigma = inputs.get("audio_timestep")
    if audio_sigma is not None:
        audio_sigma = _per_token(ctx.to_device("audio_timestep", audio_sigma, torch.float32), batch, audio_frames,
                                 "audio timestep")
    elif full_sigma.shape[1] == 1:
        audio_sigma = full_sigma
    else:
        raise ValueError("a per-token video timestep needs audio_timestep ([B] or one per audio token)")
    a2v_gate, v2a_gate = (_gate_sigma(inputs, name, default, batch, ctx) for name, default in
                          (("a2v_gate_sigma", audio_sigma), ("v2a_gate_sigma", full_sigma)))
    frame_rate = float(inputs.get("frame_rate") or DEFAULT_FRAME_RATE)
    video_text, audio_text = connect_text(model, context)
    if config.use_prompt_embeddings:
        video_text, audio_text = model.caption_projection(video_text), model.audio_caption_projection(audio_text)

    keyframes = _keyframe_positions(inputs, batch, grid, ctx)
    video_coords = comfy_video_coords(model, batch, grid_shape(grid), frame_rate, device, keyframes)[:, :, lo:hi]
    audio_coords = model.audio_rope.prepare_audio_coords(batch, audio_frames, device)
    video_tokens = grid.patches(latents.video, lo, hi).to(dtype)
    audio_tokens = latents.audio.transpose(1, 2).flatten(2).to(dtype)
    scale = config.timestep_scale_multiplier
    gate_factor = config.cross_attn_timestep_scale_multiplier / scale
    guides = 0 if keyframes is None else keyframes.shape[2]
    video_hidden = mark_pixel_frames(model, model.proj_in(video_tokens), video_coords, (lo, hi), grid.count - guides)
    video = _stream(model, "", video_hidden, sigma * scale, a2v_gate * scale * gate_factor,
                    model.rope(_self_positions(video_coords, middle), device=device),
                    model.cross_attn_rope(video_coords[:, 0:1], device=device),
                    video_text, ("av_cross_attn_video_scale_shift", "av_cross_attn_video_a2v_gate"), dtype)
    audio = _stream(model, "audio_", model.audio_proj_in(audio_tokens), audio_sigma * scale,
                    v2a_gate * scale * gate_factor,
                    model.audio_rope(_self_positions(audio_coords, middle), device=device),
                    model.cross_attn_audio_rope(audio_coords[:, 0:1], device=device),
                    audio_text, ("av_cross_attn_audio_scale_shift", "av_cross_attn_audio_v2a_gate"), dtype)
    if model.prompt_modulation and config.use_prompt_adaln_single:
        video.prompt_temb = _prompt_temb(model.prompt_adaln, full_sigma * scale, dtype)
        audio.prompt_temb = _prompt_temb(model.audio_prompt_adaln, audio_sigma * scale, dtype)
    return video, audio


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


def prompt_sigma(sigma: torch.Tensor) -> torch.Tensor:
    """[B, 1 or N] -> [B]: the sigma of LTX-2.3's prompt AdaLN, each item's largest over its tokens (ComfyUI's
    compute_prompt_timestep)."""
    return sigma.amax(dim=1)


def _prompt_temb(module, sigma: torch.Tensor, dtype) -> torch.Tensor:
    values, _ = module(prompt_sigma(sigma), batch_size=sigma.shape[0], hidden_dtype=dtype)
    return values.view(sigma.shape[0], 1, -1)


def _gate_sigma(inputs: dict, name: str, sigmas: torch.Tensor, batch: int, ctx) -> torch.Tensor:
    """A cross-modal gate's sigma as [B, 1]: the input `name`, else the largest of `sigmas` (ComfyUI's choice)."""
    given = inputs.get(name)
    value = sigmas.max() if given is None else ctx.to_device(name, torch.as_tensor(given), torch.float32)
    if value.numel() != 1:
        raise ValueError(f"{name} is one sigma for the whole call; got shape {list(value.shape)}")
    return value.reshape(1, 1).expand(batch, 1)


def _keyframe_positions(inputs: dict, batch: int, grid: VideoGrid, ctx) -> Optional[torch.Tensor]:
    """Input keyframe_idxs, checked: the pixel-space [start, end) bounds [B or 1, 3, G, 2] of the last G video
    tokens, whole latent frames (the guide frames LTXVAddGuide appends to the latent); None without guides."""
    given = inputs.get("keyframe_idxs")
    if given is None:
        return None
    positions = ctx.to_device("keyframe_idxs", given, torch.float32)
    shape = list(positions.shape)
    per_frame = grid.rows * grid.cols
    if (len(shape) != 4 or shape[0] not in (1, batch) or shape[1] != 3 or shape[3] != 2
            or not 0 < shape[2] <= grid.count or shape[2] % per_frame):
        raise ValueError(f"keyframe_idxs has shape {shape}; give the guide tokens' pixel bounds [B, 3, G, 2], G "
                         f"whole latent frames of {per_frame} tokens, at most the {grid.count} video tokens "
                         f"(ComfyUI's LTXVAddGuide makes them; crop the guides before upscaling the latent)")
    return positions


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


def grid_shape(grid: VideoGrid) -> tuple[int, int, int]:
    return grid.frames, grid.rows, grid.cols


def _stream(model, prefix: str, hidden, timestep, gate_timestep, rope, cross_rope, text, cross_modules,
            dtype) -> Stream:
    """Modulations of one modality: its own timestep for the block, the output and the cross-modal scale / shift;
    `gate_timestep` (the other stream's largest, ComfyUI's choice) for the gate of the attention into it."""
    batch = hidden.shape[0]

    def embed(module, values):
        result, embedded = module(values.flatten(), batch_size=batch, hidden_dtype=dtype)
        return result.view(batch, -1, result.shape[-1]), embedded.view(batch, -1, embedded.shape[-1])

    temb, embedded = embed(getattr(model, f"{prefix}time_embed"), timestep)
    scale_shift, _ = embed(getattr(model, cross_modules[0]), timestep)
    gate, _ = embed(getattr(model, cross_modules[1]), gate_timestep)
    return Stream(hidden, temb, embedded, scale_shift, gate, rope, cross_rope,
                  text.view(batch, -1, hidden.shape[-1]))


def _modulation(table: torch.Tensor, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    values = table[None, None].to(temb.device) + temb.reshape(temb.shape[0], temb.shape[1], table.shape[0], -1)
    return values.unbind(dim=2)


def _rotate(attn, tensor: torch.Tensor, rope) -> torch.Tensor:
    from diffusers.models.transformers.transformer_ltx2 import apply_interleaved_rotary_emb, apply_split_rotary_emb
    rotate = apply_interleaved_rotary_emb if attn.rope_type == "interleaved" else apply_split_rotary_emb
    return rotate(tensor, rope)


def _heads(attn, query_in, key_in, query_rope, key_rope) -> tuple[torch.Tensor, ...]:
    """q, k, v [B, n, H, D] of an LTX2Attention (q/k RMS-normed across heads, then rotated)."""
    query = attn.norm_q(attn.to_q(query_in))
    key = attn.norm_k(attn.to_k(key_in))
    value = attn.to_v(key_in)
    if query_rope is not None:
        query, key = _rotate(attn, query, query_rope), _rotate(attn, key, key_rope)
    return tuple(tensor.unflatten(2, (attn.heads, -1)) for tensor in (query, key, value))


def _out(attn, attended: torch.Tensor, like: torch.Tensor, query_in: torch.Tensor) -> torch.Tensor:
    """The output projection of attended [B, n, H, D], after LTX-2.3's per-head gates (2 sigmoid of logits from
    the query input: each token's own, so exact on any shard)."""
    attended = attended.to(like.dtype)
    if attn.to_gate_logits is not None:
        attended = attended * (2.0 * torch.sigmoid(attn.to_gate_logits(query_in))).unsqueeze(-1)
    return attn.to_out[0](attended.flatten(2, 3))


def _text_attention(block, prefix: str, hidden: torch.Tensor, stream: Stream, query_mod: tuple) -> torch.Tensor:
    """The prompt cross-attention of one modality; LTX-2.3 / 2.5 modulate its query (shift, scale, gate of the
    block's rows 6-8) and the prompt (the block's prompt table plus the prompt AdaLN, or the table alone)."""
    normed = getattr(block, f"{prefix}norm2")(hidden)
    text = stream.text
    if query_mod:
        shift, scale, _ = query_mod
        normed = normed * (1 + scale) + shift
        table = getattr(block, f"{prefix}prompt_scale_shift_table")
        shift_kv, scale_kv = (_modulation(table, stream.prompt_temb) if stream.prompt_temb is not None
                              else table[None, None].to(text.dtype).unbind(dim=2))
        text = text * (1 + scale_kv) + shift_kv
    out = getattr(block, f"{prefix}attn2")(normed, encoder_hidden_states=text)
    return out * query_mod[2] if query_mod else out


def _block(block, video: Stream, audio: Stream, seq, shards: SeqShards) -> tuple[torch.Tensor, torch.Tensor]:
    """ComfyUI's BasicAVTransformerBlock.forward (with LTX-2.3 / 2.5's attention gates and prompt AdaLN) on this
    rank's tokens, with diffusers' modules. Unlike diffusers' block, the video-to-audio attention reads the video
    normalised after the audio-to-video residual."""
    v, a = video.hidden, audio.hidden
    v_mods = _modulation(block.scale_shift_table, video.temb)
    a_mods = _modulation(block.audio_scale_shift_table, audio.temb)
    v_shift, v_scale, v_gate, v_shift_mlp, v_scale_mlp, v_gate_mlp = v_mods[:6]
    a_shift, a_scale, a_gate, a_shift_mlp, a_scale_mlp, a_gate_mlp = a_mods[:6]
    normed = block.norm1(v) * (1 + v_scale) + v_shift
    query, key, value = _heads(block.attn1, normed, normed, video.rope, video.rope)
    attended, _ = sp_attention(query, key, value, seq, shards)
    v = v + _out(block.attn1, attended, v, normed) * v_gate

    normed = block.audio_norm1(a) * (1 + a_scale) + a_shift
    a = a + block.audio_attn1(normed, query_rotary_emb=audio.rope) * a_gate
    v = v + _text_attention(block, "", v, video, v_mods[6:])
    a = a + _text_attention(block, "audio_", a, audio, a_mods[6:])

    a_normed = block.video_to_audio_norm(a)
    v_a2v_scale, v_a2v_shift, v_v2a_scale, v_v2a_shift = _modulation(
        block.video_a2v_cross_attn_scale_shift_table[:4], video.cross_scale_shift)
    a_a2v_scale, a_a2v_shift, a_v2a_scale, a_v2a_shift = _modulation(
        block.audio_a2v_cross_attn_scale_shift_table[:4], audio.cross_scale_shift)
    a2v_gate = _modulation(block.video_a2v_cross_attn_scale_shift_table[4:], video.cross_gate)[0]
    v2a_gate = _modulation(block.audio_a2v_cross_attn_scale_shift_table[4:], audio.cross_gate)[0]

    a2v = block.audio_to_video_attn(block.audio_to_video_norm(v) * (1 + v_a2v_scale) + v_a2v_shift,
                                    encoder_hidden_states=a_normed * (1 + a_a2v_scale) + a_a2v_shift,
                                    query_rotary_emb=video.cross_rope, key_rotary_emb=audio.cross_rope)
    v = v + a2v * a2v_gate
    v2a_query = a_normed * (1 + a_v2a_scale) + a_v2a_shift
    query, key, value = _heads(block.video_to_audio_attn, v2a_query,
                               block.audio_to_video_norm(v) * (1 + v_v2a_scale) + v_v2a_shift, audio.cross_rope,
                               video.cross_rope)
    v2a = _out(block.video_to_audio_attn, attention_over_key_shards(query, key, value, seq), a, v2a_query)
    a = a + v2a * v2a_gate

    v = v + block.ff(block.norm3(v) * (1 + v_scale_mlp) + v_shift_mlp) * v_gate_mlp
    a = a + block.audio_ff(block.audio_norm3(a) * (1 + a_scale_mlp) + a_shift_mlp) * a_gate_mlp
    return v, a


def _head(model, stream: Stream, prefix: str) -> torch.Tensor:
    table = getattr(model, f"{prefix}scale_shift_table")
    values = table[None, None] + stream.embedded[:, :, None]
    shift, scale = values[:, :, 0], values[:, :, 1]
    hidden = getattr(model, f"{prefix}norm_out")(stream.hidden) * (1 + scale) + shift
    return getattr(model, f"{prefix}proj_out")(hidden)


# ---------------------------------------------------------------------------------------------------------------
# Single-device reference (tests, CLI demo): diffusers' stock forward with ComfyUI's choices hooked in

def reference_forward(model, video: torch.Tensor, audio: torch.Tensor, timestep: torch.Tensor,
                      context: torch.Tensor, audio_timestep: Optional[torch.Tensor] = None,
                      frame_rate: float = DEFAULT_FRAME_RATE, comfy: bool = True,
                      keyframe_idxs: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' LTX2VideoTransformer3DModel.forward on the whole sequence, given ComfyUI's video token times
    (comfy_video_coords, with guide tokens' keyframe_idxs), the prompt through diffusers' own connector forward
    (padding replaced by registers), LTX-2.5's keyframe marker on the first latent frame's tokens (diffusers'
    video_keyframes_mask) and (comfy=True) ComfyUI's gates and video-to-audio norm hooked in (comfy_hooks): (video
    velocity [B, C, F, H, W], audio [B, C, T, M]). For files with use_middle_indices_grid (diffusers' rope always takes token middles)."""
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
