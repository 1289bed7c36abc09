"""SeedVR2's single-device reference (tests): a plain forward written from ComfyUI's NaDiT (comfy/ldm/seedvr/model.py)
over our modules' weights: per batch item, the patch grid [T, H, W, C]; per block, the grid cut into windows (plain,
then shifted in odd blocks), each window's video with the whole text attended in one SDPA, window-local rotary built
as axial tables and applied as rotate-half on pairs, the text's outputs averaged over the windows. Independent of
the plan's index maps and gathered keys (window sizes re-derived here from ComfyUI's formulas)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from sp_runtime.families.seedvr2 import load_model
from sp_lab.references import as_model


def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, context=None, condition=None,
                      dtype: str = "default", **_ignored) -> torch.Tensor:
    """ComfyUI's SeedVR2 diffusion_model(x [B, 16, T, H, W], timestep, context [B, L, C], condition [B, 17, T, H, W])
    with every batch item paired with its own context (one branch: ComfyUI's order)."""
    model = as_model(model_or_path, load_model, dtype)
    config = model.config
    compute = model.vid_out.proj.weight.dtype
    batch = x.shape[0]
    condition = condition.expand(batch, *condition.shape[1:])
    if context is None or not context.numel():
        context = model.positive_conditioning[None]
    context = context.expand(batch, *context.shape[1:])
    outs = []
    with torch.no_grad():
        for item in range(batch):
            emb = model.time(timestep.reshape(-1).expand(batch)[item:item + 1].float(), compute)
            latent = torch.cat([x[item], condition[item]]).to(compute)  # [33, T, H, W]
            outs.append(_item(model, config, latent, context[item:item + 1].to(compute), emb))
    return torch.cat(outs).to(x.dtype)


def _item(model, config, latent, text, emb):
    channels, frames, height, width = latent.shape
    grid = latent.reshape(channels, frames, height // 2, 2, width // 2, 2).permute(1, 2, 4, 3, 5, 0)
    grid = grid.reshape(frames, height // 2, width // 2, 4 * channels)  # features (ph, pw, c)
    vid = model.vid_in.proj(grid)[None]  # [1, T, h, w, dim]
    txt = model.txt_in(text)
    for index, block in enumerate(model.blocks):
        vid, txt = _block(block, config, vid, txt, emb, shifted=index % 2 == 1)
    out = model.head(vid.flatten(1, 3), emb).reshape(frames, height // 2, width // 2, 2, 2, -1)
    return out.permute(5, 0, 1, 3, 2, 4).reshape(1, -1, frames, height, width)


def _block(block, config, vid, txt, emb, shifted):
    shape = vid.shape[1:4]
    vid_flat = vid.flatten(1, 3)
    vq, vk, vv = block.attn.qkv("vid", block.modulate("vid", F.rms_norm(vid_flat, (vid.shape[-1],), eps=block.eps),
                                                      emb, "attn"))
    tq, tk, tv = block.attn.qkv("txt", block.modulate("txt", F.rms_norm(txt, (txt.shape[-1],), eps=block.eps),
                                                      emb, "attn"))
    grid_q, grid_k, grid_v = (t.reshape(1, *shape, *t.shape[2:]) for t in (vq, vk, vv))
    if config.variant == "3b":
        text_freqs = _lang(config.rope_frequencies)
        text_table = (torch.arange(txt.shape[1]).float()[:, None] * text_freqs[None]).repeat(1, 3)
        tq, tk = _rope(tq, text_table), _rope(tk, text_table)
    out = torch.zeros_like(grid_q)
    txt_sum, count = torch.zeros_like(tq), 0
    for window in _windows(tuple(shape), shifted):
        wq, wk, wv = (g[(slice(None), *window)] for g in (grid_q, grid_k, grid_v))
        wshape = wq.shape[1:4]
        wq, wk, wv = (t.reshape(1, -1, *t.shape[4:]) for t in (wq, wk, wv))
        table = _window_table(config, wshape, txt.shape[1])
        wq, wk = _rope(wq, table), _rope(wk, table)
        q, k, v = (torch.cat(pair, dim=1).transpose(1, 2) for pair in ((wq, tq), (wk, tk), (wv, tv)))
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
        out[(slice(None), *window)] = attended[:, :wq.shape[1]].reshape(1, *wshape, *attended.shape[2:])
        txt_sum += attended[:, wq.shape[1]:]
        count += 1
    vid_attn = block.attn.proj_out.of("vid")(out.reshape(1, -1, out.shape[-2] * out.shape[-1]))
    vid_flat = vid_flat + block.gate("vid", vid_attn, emb, "attn")
    vid_flat = block.feed_forward("vid", vid_flat, emb)
    if not block.last:
        txt_attn = block.attn.proj_out.of("txt")((txt_sum / count).flatten(2))
        txt = block.feed_forward("txt", txt + block.gate("txt", txt_attn, emb, "attn"), emb)
    return vid_flat.reshape(vid.shape), txt


def _windows(size, shifted):
    """ComfyUI's make_720Pwindows_bysize / make_shifted_720Pwindows_bysize with (4, 3, 3) windows."""
    t, h, w = size
    scale = math.sqrt(45 * 80 / (h * w))
    wt, wh, ww = math.ceil(min(t, 30) / 4), math.ceil(round(h * scale) / 3), math.ceil(round(w * scale) / 3)
    st, sh, sw = ((0.5 if wt < t else 0, 0.5 if wh < h else 0, 0.5 if ww < w else 0) if shifted else (0, 0, 0))
    nt, nh, nw = (math.ceil((n - s) / e) + (1 if s > 0 else 0) for n, s, e in ((t, st, wt), (h, sh, wh), (w, sw, ww)))
    cut = lambda i, s, e, n: slice(max(int((i - s) * e), 0), min(int((i - s + 1) * e), n))  # noqa: E731
    return [(cut(it, st, wt, t), cut(ih, sh, wh, h), cut(iw, sw, ww, w))
            for iw in range(nw) if cut(iw, sw, ww, w).stop > cut(iw, sw, ww, w).start
            for ih in range(nh) if cut(ih, sh, wh, h).stop > cut(ih, sh, wh, h).start
            for it in range(nt) if cut(it, st, wt, t).stop > cut(it, st, wt, t).start]


def _lang(count):
    return 1.0 / (10000 ** (torch.arange(0, 2 * count, 2)[:count].float() / (2 * count)))


def _window_table(config, wshape, text_len):
    """Angles [window tokens, 3 count] of a window of shape (f, h, w) (ComfyUI's get_axial_freqs)."""
    count = config.rope_frequencies
    if config.variant == "3b":
        freqs = _lang(count)
        axes = [torch.arange(text_len, text_len + wshape[0]).float(), torch.arange(wshape[1]).float(),
                torch.arange(wshape[2]).float()]
    else:
        freqs = torch.linspace(1.0, 128.0, count) * math.pi
        axes = [torch.linspace(-1, 1, steps=n) for n in wshape]
    parts = []
    for axis, positions in enumerate(axes):
        view = [1, 1, 1, count]
        view[axis] = len(positions)
        parts.append((positions[:, None] * freqs[None]).reshape(view).expand(*wshape, count))
    return torch.cat(parts, dim=-1).reshape(-1, 3 * count)


def _rope(t, table):
    """Rotate-half on consecutive pairs of the first 2 x table-width channels of t [1, n, H, D] (float32)."""
    angles = table.repeat_interleave(2, dim=1)[None, :, None, :].to(t.device)
    rotated = t[..., :angles.shape[-1]].float()
    pairs = rotated.unflatten(-1, (-1, 2))
    half = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
    rotated = rotated * angles.cos() + half * angles.sin()
    return torch.cat([rotated.to(t.dtype), t[..., angles.shape[-1]:]], dim=-1)
