"""Z-Image's single-device reference (tests): diffusers' stock forward, fed ComfyUI's call in its own convention;
Ming-Image (5-D x) composed from diffusers' own modules as ComfyUI's NextDiT lays its sequence out (diffusers' forward
always pads with learned tokens and has no reference frames)."""
from __future__ import annotations

from contextlib import contextmanager

import torch

from sp_runtime.families.z_image import PATCH, load_model
from sp_lab.references import as_model


def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      dtype: str = "default", rope_options=None, **_ignored) -> torch.Tensor:
    """ComfyUI's Z-Image diffusion_model(...) computed by diffusers' own forward on one process: per-item lists,
    t = 1 - sigma, the latent padded to the patch by wrap-around (ComfyUI's circular padding), output negated;
    ScaleROPE's rope_options placed as ComfyUI's pos_ids_x."""
    model = as_model(model_or_path, load_model, dtype)
    if x.dim() == 5:
        return ming_forward(model, x, timestep, context, rope_options=rope_options, **_ignored)
    weight = model.all_x_embedder[f"{PATCH}-1"].weight
    compute, device = weight.dtype, weight.device
    height, width = x.shape[-2:]
    padded = torch.cat([x, x[:, :, :height % PATCH]], dim=2)
    padded = torch.cat([padded, padded[:, :, :, :width % PATCH]], dim=3)
    context = context.expand(x.shape[0], -1, -1)
    sigma = timestep.reshape(-1).expand(x.shape[0]).float()
    with torch.no_grad(), _scaled_image_rope(model, rope_options):
        outputs = model([item[:, None].to(device, compute) for item in padded], (1 - sigma).to(device),
                        [item.to(device, compute) for item in context], return_dict=False)[0]
    return -torch.stack(outputs)[:, :, 0, :height, :width].to(x.dtype).cpu()


@contextmanager
def _scaled_image_rope(model, rope_options):
    """diffusers' rotary embedder swapped for one that moves the image tokens' rows and columns as ComfyUI's pos_ids_x
    (row * scale_y + shift_y, col * scale_x + shift_x in float32; frame, pads and caption unchanged) and computes the
    factors of those fractional positions as diffusers' precompute_freqs_cis does for integer ones."""
    if not rope_options:
        yield
        return
    stock = model.rope_embedder
    model.rope_embedder = lambda ids: _rotary(stock, _image_positions(ids, rope_options))
    try:
        yield
    finally:
        model.rope_embedder = stock


def _image_positions(ids: torch.Tensor, options: dict) -> torch.Tensor:
    positions = ids.float()
    if not bool(ids[:, 1:].any()):  # the caption's ids (frame, 0, 0): an image larger than one token has a row or col
        return positions
    image = ids[:, 0] != 0  # pads are (0, 0, 0)
    positions[image, 1] = positions[image, 1] * options.get("scale_y", 1.0) + options.get("shift_y", 0.0)
    positions[image, 2] = positions[image, 2] * options.get("scale_x", 1.0) + options.get("shift_x", 0.0)
    return positions


def _rotary(stock, positions: torch.Tensor) -> torch.Tensor:
    factors = []
    for axis, dim in enumerate(stock.axes_dims):
        inverse = 1.0 / (stock.theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        angles = torch.outer(positions[:, axis].cpu().double(), inverse).float()
        factors.append(torch.polar(torch.ones_like(angles), angles).to(positions.device))
    return torch.cat(factors, dim=-1)


def ming_forward(model, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor, direct_context=None,
                 ref_frames=(), rope_options=None, **_ignored) -> torch.Tensor:
    """ComfyUI's Ming-Image call on one process with diffusers' blocks: caption (+ direct_context at the model width,
    + learned pads where the model has them) with ids (1 + i, 0, 0); target frame f at frame index s + 1 + f and
    reference frame j at s + 1 + F + j, s the caption length rounded up to 32; every latent padded to the patch by
    wrap-around, patches in (row, col, channel) order; the refiners, then the main layers over caption + image;
    the target frames' tokens out, unpatchified and negated."""
    weight = model.all_x_embedder[f"{PATCH}-1"].weight
    compute, device = weight.dtype, weight.device
    batch, channels, frames, height, width = x.shape
    with torch.no_grad():
        sigma = timestep.reshape(-1).expand(batch).float().to(device)
        adaln = model.t_embedder((1 - sigma) * model.config.t_scale).to(compute)
        caption = model.cap_embedder(context.to(device, compute).expand(batch, -1, -1))
        if direct_context is not None:
            caption = torch.cat([caption, direct_context.to(device, compute)], dim=1)
        if model.cap_pad_token is not None:
            caption = torch.cat([caption, model.cap_pad_token.expand(batch, -(-caption.shape[1] // 32) * 32
                                                                      - caption.shape[1], -1)], dim=1)
        shift = -(-caption.shape[1] // 32) * 32
        caption_ids = torch.zeros(caption.shape[1], 3)
        caption_ids[:, 0] = torch.arange(caption.shape[1]) + 1
        latents = [(x[:, :, f], shift + 1 + f) for f in range(frames)]
        latents += [(ref, shift + 1 + frames + j) for j, ref in enumerate(ref_frames or ())]
        pieces, ids = [], []
        for latent, index in latents:
            tokens, where = _patches(latent, index, rope_options)
            pieces.append(model.all_x_embedder[f"{PATCH}-1"](tokens.to(device, compute)).expand(batch, -1, -1))
            ids.append(where)
        image, image_ids = torch.cat(pieces, dim=1), torch.cat(ids)
        if model.x_pad_token is not None:
            extra = -(-image.shape[1] // 32) * 32 - image.shape[1]
            image = torch.cat([image, model.x_pad_token.expand(batch, extra, -1)], dim=1)
            image_ids = torch.cat([image_ids, torch.zeros(extra, 3)])
        caption_rope, image_rope = _rope(model, caption_ids, device), _rope(model, image_ids, device)
        for layer in model.context_refiner:
            caption = layer(caption, None, caption_rope)
        for layer in model.noise_refiner:
            image = layer(image, None, image_rope, adaln)
        joint, rope = torch.cat([caption, image], dim=1), torch.cat([caption_rope, image_rope], dim=1)
        for layer in model.layers:
            joint = layer(joint, None, rope, adaln)
        out = model.all_final_layer[f"{PATCH}-1"](joint[:, caption.shape[1]:], c=adaln)
    rows, cols = -(-height // PATCH), -(-width // PATCH)
    out = out[:, :frames * rows * cols].unflatten(1, (frames, rows, cols)).unflatten(-1, (PATCH, PATCH, channels))
    out = out.permute(0, 6, 1, 2, 4, 3, 5).reshape(batch, channels, frames, rows * PATCH, cols * PATCH)
    return -out[..., :height, :width].to(x.dtype).cpu()


def _patches(latent: torch.Tensor, index: int, rope_options) -> tuple[torch.Tensor, torch.Tensor]:
    height, width = latent.shape[-2:]
    padded = torch.cat([latent, latent[:, :, :height % PATCH]], dim=2)
    padded = torch.cat([padded, padded[:, :, :, :width % PATCH]], dim=3)
    b, c, h, w = padded.shape
    tokens = padded.view(b, c, h // PATCH, PATCH, w // PATCH, PATCH).permute(0, 2, 4, 3, 5, 1).flatten(3).flatten(1, 2)
    options = rope_options or {}
    ids = torch.zeros(h // PATCH, w // PATCH, 3)
    ids[..., 0] = index
    ids[..., 1] = (torch.arange(h // PATCH) * options.get("scale_y", 1.0) + options.get("shift_y", 0.0))[:, None]
    ids[..., 2] = (torch.arange(w // PATCH) * options.get("scale_x", 1.0) + options.get("shift_x", 0.0))[None, :]
    return tokens, ids.flatten(0, 1)


def _rope(model, ids: torch.Tensor, device) -> torch.Tensor:
    """diffusers' rotary factors of the ids ([1, n, dim / 2]); fractional positions computed as _rotary does."""
    if torch.equal(ids, ids.round()):
        return model.rope_embedder(ids.long().to(device))[None]
    return _rotary(model.rope_embedder, ids.to(device))[None]
