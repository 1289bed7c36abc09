"""MiniMax H3 single-device reference: diffusers' stock MiniMaxH3Transformer3DModel forward fed ComfyUI's call as
its MiniMaxH3Model builds the packed sequence ([text | keyframe rows | reference blocks | audio | video], (t, h, w)
positions, per-row timesteps and modality tags, the text encoder's per-token tags), the output negated and unpacked as ComfyUI returns it. Pruned files (the curve time
embedding) run the same forward with the AdaLN projections reading the curve without an activation, as ComfyUI's
pruned path does. Written apart from the plan on purpose (diffusers' own rotary and AdaLN indexing)."""
from __future__ import annotations

import contextlib
import math
import types

import torch

RESCALE, PER_TOKEN = 5.0 / 3.0, (1, 4, 4, 4, 4)


def _shift(sigma, from_shift, to_shift):
    base = sigma / (from_shift + sigma * (1.0 - from_shift))
    return to_shift * base / (1.0 + (to_shift - 1.0) * base)


def _rows(latent):
    b, c, t, h, w = latent.shape
    return latent.reshape(b, c, t, h // 2, 2, w // 2, 2).permute(0, 2, 3, 5, 1, 4, 6).reshape(b, -1, c * 4)


def _frame(h, w):
    area = math.sqrt(h * w)
    axes = [(torch.arange(n // 2, dtype=torch.float64) * (n / area / (n // 2)) + (1 - n / area) / 2) * 32
            for n in (h, w)]
    hh, ww = torch.meshgrid(*axes, indexing="ij")
    return torch.stack([hh.flatten(), ww.flatten()], -1), axes[1]


def _video_positions(frames, frame, origin):
    times = [origin]
    for k in range(frames - 1):
        times.append(times[-1] + RESCALE * PER_TOKEN[k % 5])
    return torch.cat([torch.cat([torch.full((frame.shape[0], 1), t, dtype=torch.float64), frame], 1) for t in times])


@contextlib.contextmanager
def _no_adaln_activation(model):
    """Pruned files: diffusers' AdaLN modules call nn.functional.silu on the time embedding; the curve form has
    none (its module namespace sees an identity silu while the forward runs)."""
    module = __import__(type(model).__module__, fromlist=["nn"])
    if not hasattr(model.time_embedder, "table"):
        yield
        return
    real = module.nn
    module.nn = types.SimpleNamespace(functional=types.SimpleNamespace(silu=lambda x: x))
    try:
        yield
    finally:
        module.nn = real


@contextlib.contextmanager
def _one_head_each(model, sigma, sample_sigmas, channels):
    """FastH3's head bank as the step's single heads (head 0 plus the dt-weighted offsets of the heads its interval
    of the sampler's sigmas spans), swapped in for the forward."""
    heads = model.proj_out.out_features // channels
    if heads == 1:
        yield
        return
    saved = model.proj_out, model.audio_proj_out
    sigmas = sample_sigmas.flatten().float()
    following = float(sigmas[min(int((sigmas - sigma).abs().argmin()) + 1, len(sigmas) - 1)])
    start, stop = (round((1.0 - _shift(value, 12.0, 1.0)) * heads) for value in (sigma, following))
    start = min(start, heads - 1)
    stop = max(stop, start + 1)
    for name, shift in (("proj_out", 12.0), ("audio_proj_out", 3.0)):
        bank = getattr(model, name)
        grid = [1.0 - i / heads for i in range(heads + 1)]
        warped = [1.0 - shift * g / (1.0 + (shift - 1.0) * g) for g in grid]
        dt = [warped[i + 1] - warped[i] for i in range(start, stop)]
        weights = [d / sum(dt) for d in dt]
        single = torch.nn.Linear(bank.in_features, bank.out_features // heads).to(bank.weight)
        rows, biases = bank.weight.unflatten(0, (heads, -1)), bank.bias.unflatten(0, (heads, -1))
        single.weight.data = rows[0] + sum(w * rows[i] for w, i in zip(weights, range(start, stop)) if i >= 1)
        single.bias.data = biases[0] + sum(w * biases[i] for w, i in zip(weights, range(start, stop)) if i >= 1)
        setattr(model, name, single)
    try:
        yield
    finally:
        model.proj_out, model.audio_proj_out = saved


def _span(kind, latent, audio):
    if kind == "image":
        return 1.0
    steps = 0.0 if audio is None else float(audio.shape[-1])
    if kind == "audio":
        return steps
    return max(steps, sum(RESCALE * PER_TOKEN[k % 5] for k in range(latent.shape[2])))


def _audio_positions(origin, steps, low, high):
    grid = torch.zeros(2 * steps, 3, dtype=torch.float64)
    grid[:, 0] = (origin + torch.arange(steps, dtype=torch.float64)).repeat(2)
    grid[:steps, 2], grid[steps:, 2] = low, high
    return grid


def _audio_rows(audio):
    return audio.float().permute(0, 2, 3, 1).reshape(audio.shape[0], 2 * audio.shape[3], -1)


def reference_forward(model, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor, latent_shapes,
                      keyframe_latents=(), keyframe_frames=(), keyframe_timestep=0.999, sample_sigmas=None,
                      references=(), text_token_tags=None, audio_cond_timestep=1.0, keyframe_audio_latents=(),
                      keyframe_audio_frames=(), **_ignored) -> torch.Tensor:
    weight = model.proj_out.weight
    device, dtype = weight.device, weight.dtype
    video_shape, audio_shape = latent_shapes
    split = math.prod(video_shape[1:])
    flat = x.reshape(x.shape[0], -1)
    video = flat[:, :split].reshape(x.shape[0], *video_shape[1:])
    audio = flat[:, split:].reshape(x.shape[0], *audio_shape[1:])
    frame, w_axis = _frame(video.shape[3], video.shape[4])
    text_len, steps = context.shape[1], audio.shape[3]
    sigma = float((timestep.flatten()[0] / 1000.0).float().clamp(min=1e-6))
    t_video, t_audio = 1.0 - sigma, 1.0 - _shift(sigma, 12.0, 3.0)
    t_key, t_ref_audio = max(t_video, keyframe_timestep), max(t_audio, audio_cond_timestep)
    batch = x.shape[0]
    # segments: (modality "text" / "video" / "audio", rows or None, positions, timestep, tag)
    text_pos = torch.zeros(text_len, 3, dtype=torch.float64)
    text_pos[:, 0] = torch.arange(text_len, dtype=torch.float64)
    segments = [("text", None, text_pos, t_video, 1)]
    target_origin = text_len + sum(_span(r["kind"], r.get("latent"), r.get("audio")) for r in references)
    for latent, index in zip(keyframe_latents, keyframe_frames):
        segments.append(("video", _rows(latent.float()).expand(batch, -1, -1),
                         _video_positions(latent.shape[2], frame, target_origin + RESCALE * index), t_key, 0))
    for latent, index in zip(keyframe_audio_latents, keyframe_audio_frames):
        segments.append(("audio", _audio_rows(latent).expand(batch, -1, -1),
                         _audio_positions(target_origin + RESCALE * index, latent.shape[3], w_axis[0], w_axis[-1]),
                         t_ref_audio, 2))
    origin = float(text_len)
    for ref in references:
        latent, ref_audio = ref.get("latent"), ref.get("audio")
        if ref_audio is not None:
            ends = (w_axis[0], w_axis[-1]) if ref["kind"] == "audio" else \
                (lambda axis: (axis[0], axis[-1]))(_frame(latent.shape[3], latent.shape[4])[1])
            segments.append(("audio", _audio_rows(ref_audio).expand(batch, -1, -1),
                             _audio_positions(origin, ref_audio.shape[3], *ends), t_ref_audio, 2))
        if latent is not None:
            ref_frame = _frame(latent.shape[3], latent.shape[4])[0]
            segments.append(("video", _rows(latent.float()).expand(batch, -1, -1),
                             _video_positions(latent.shape[2], ref_frame, origin), t_key, 0))
        origin += _span(ref["kind"], latent, ref_audio)
    segments.append(("audio", _audio_rows(audio), _audio_positions(target_origin, steps, w_axis[0], w_axis[-1]),
                     t_audio, 2))
    segments.append(("video", _rows(video.float()), _video_positions(video.shape[2], frame, target_origin), t_video, 0))
    counts = [text_len if rows is None else rows.shape[1] for _, rows, _, _, _ in segments]
    distinct = sorted({t for _, _, _, t, _ in segments} | {t_video, t_audio})
    step_index = torch.cat([torch.full((n,), distinct.index(seg[3])) for seg, n in zip(segments, counts)])
    tags = torch.cat([torch.full((n,), seg[4]) for seg, n in zip(segments, counts)])
    if text_token_tags is not None:
        tags[:text_len] = text_token_tags.long()
    modality = [seg[0] for seg, n in zip(segments, counts) for _ in range(n)]
    where = {name: torch.tensor([i for i, m in enumerate(modality) if m == name]) for name in ("text", "video", "audio")}
    with torch.no_grad(), _no_adaln_activation(model), \
            _one_head_each(model, sigma, sample_sigmas, video_shape[1] * 4):
        out_video, out_audio = model(
            hidden_states=torch.cat([s[1] for s in segments if s[0] == "video"], 1).to(device, dtype),
            audio_hidden_states=torch.cat([s[1] for s in segments if s[0] == "audio"], 1).to(device, dtype),
            encoder_hidden_states=context.to(device, dtype), timestep=torch.tensor(distinct, device=device),
            timestep_indices=step_index.to(device), token_tags=tags.to(device),
            position_ids=torch.cat([s[2] for s in segments]).to(device), video_indices=where["video"].to(device),
            audio_indices=where["audio"].to(device), text_indices=where["text"].to(device), return_dict=False)
    b, c, t, h, w = video.shape
    target = out_video[:, -t * (h // 2) * (w // 2):].float().cpu()
    video_out = target.reshape(b, t, h // 2, w // 2, c, 2, 2).permute(0, 4, 1, 2, 5, 3, 6).reshape(video.shape)
    audio_out = out_audio[:, -2 * steps:].float().cpu().reshape(b, 2, steps, -1).permute(0, 3, 1, 2)
    return -torch.cat([video_out.flatten(1), audio_out.flatten(1)], 1).unsqueeze(1).to(x.dtype)
