"""Z-Image's single-device reference (tests): diffusers' stock forward, fed ComfyUI's call in its own convention."""
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
