"""OmniGen2's single-device reference (tests): ComfyUI's OmniGen2Transformer2DModel forward written out plainly from
its facts over the model's own blocks (diffusers' Lumina 2 blocks with their stock attention processor): diffusers
has no OmniGen2 class to run."""
from __future__ import annotations

import torch

from sp_runtime.families.omnigen2 import PATCH, load_model
from sp_lab.references import as_model

THETA = 10000.0


def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      ref_latents=None, dtype: str = "default", **_ignored) -> torch.Tensor:
    """diffusion_model(x, timestep, context, num_tokens, ref_latents) on one process: every caption token counted,
    t = 1 - sigma, latents padded to the patch by wrap-around, reference j's tokens plus image_index_embedding[j],
    output negated and cropped."""
    model = as_model(model_or_path, load_model, dtype)
    weight = model.x_embedder.weight
    compute, device, batch = weight.dtype, weight.device, x.shape[0]
    height, width = x.shape[-2:]
    sigma = timestep.reshape(-1).expand(batch).float().to(device)
    context = context.expand(batch, -1, -1).to(device, compute)
    refs = [ref.expand(batch, -1, -1, -1).to(device, compute) for ref in (ref_latents or [])]
    with torch.no_grad():
        embed = model.time_caption_embed
        temb = embed.timestep_embedder(embed.time_proj(1 - sigma).to(compute))
        caption = embed.caption_embedder(context)
        captions = caption.shape[1]
        caption_pos = torch.arange(captions, dtype=torch.float64)[:, None].repeat(1, 3)
        ref_tokens, ref_pos, shift = [], [], captions
        for index, ref in enumerate(refs):
            patches, rows, cols = _patchify(ref)
            ref_tokens.append(model.ref_image_patch_embedder(patches) + model.image_index_embedding[index])
            ref_pos.append(_grid_positions(shift, rows, cols))
            shift += max(rows, cols)
        patches, rows, cols = _patchify(x.to(device, compute))
        image = model.x_embedder(patches)
        image_pos = _grid_positions(shift, rows, cols)
        axes = model.config.axes_dim_rope
        for block in model.context_refiner:
            caption = block(caption, None, _freqs(caption_pos, axes, batch, device))
        for block in model.noise_refiner:
            image = block(image, None, _freqs(image_pos, axes, batch, device), temb)
        joint_parts, joint_pos = [caption], [caption_pos]
        if refs:
            reference, positions = torch.cat(ref_tokens, dim=1), torch.cat(ref_pos)
            for block in model.ref_image_refiner:
                reference = block(reference, None, _freqs(positions, axes, batch, device), temb)
            joint_parts.append(reference)
            joint_pos.append(positions)
        joint = torch.cat([*joint_parts, image], dim=1)
        freqs = _freqs(torch.cat([*joint_pos, image_pos]), axes, batch, device)
        for block in model.layers:
            joint = block(joint, None, freqs, temb)
        out = model.norm_out(joint, temb)[:, -image.shape[1]:]
    channels = x.shape[1]
    out = out.reshape(batch, rows, cols, PATCH, PATCH, channels).permute(0, 5, 1, 3, 2, 4)
    out = out.reshape(batch, channels, rows * PATCH, cols * PATCH)[:, :, :height, :width]
    return -out.to(x.dtype).cpu()


def _patchify(latent: torch.Tensor):
    """[B, C, H, W] padded to the patch (circular, as ComfyUI's pad_to_patch_size) -> [B, rows * cols, (p1 p2 c)]."""
    pad_h, pad_w = (-latent.shape[-2]) % PATCH, (-latent.shape[-1]) % PATCH
    latent = torch.nn.functional.pad(latent, (0, pad_w, 0, pad_h), mode="circular")
    b, c, h, w = latent.shape
    rows, cols = h // PATCH, w // PATCH
    tokens = latent.reshape(b, c, rows, PATCH, cols, PATCH).permute(0, 2, 4, 3, 5, 1)
    return tokens.reshape(b, rows * cols, PATCH * PATCH * c), rows, cols


def _grid_positions(shift: int, rows: int, cols: int) -> torch.Tensor:
    row = torch.arange(rows, dtype=torch.float64)[:, None].expand(rows, cols).flatten()
    col = torch.arange(cols, dtype=torch.float64)[None, :].expand(rows, cols).flatten()
    return torch.stack([torch.full_like(row, shift), row, col], dim=1)


def _freqs(positions: torch.Tensor, axes, batch: int, device) -> torch.Tensor:
    """Complex rotations [B, S, head_dim / 2] of each token's three positions (Flux-style axes, theta 10000)."""
    pieces = []
    for axis, dim in enumerate(axes):
        inverse = 1.0 / THETA ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angles = positions[:, axis:axis + 1] * inverse[None, :]
        pieces.append(torch.polar(torch.ones_like(angles), angles))
    return torch.cat(pieces, dim=-1).to(torch.complex64)[None].expand(batch, -1, -1).to(device)
