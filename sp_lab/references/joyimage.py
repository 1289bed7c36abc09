"""JoyAI-Image-Edit's single-device reference (tests, demo, benchmarks): diffusers' JoyImageEditPlusTransformer3DModel
forward (per-component rotary: the output first, then each reference, frames counted on, rows and columns from 0)
fed ComfyUI's call: the latents padded by wrap-around to whole patches, patchified and concatenated, the output's
tokens unpatchified and cropped to x's size."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from sp_runtime.families.joyimage import load_model
from sp_lab.references import as_model


def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      ref_latents=None, dtype: str = "default", **_ignored) -> torch.Tensor:
    """ComfyUI's JoyImage diffusion_model(x [B, C, T, H, W], timestep (sigma x 1000), context, ref_latents)."""
    model = plus_model(as_model(model_or_path, load_model, dtype))
    compute, device = model.proj_out.weight.dtype, model.proj_out.weight.device
    batch, patch = x.shape[0], tuple(model.config.patch_size)
    latents = [x, *(ref.expand(batch, *ref.shape[1:]) for ref in ref_latents or [])]
    pieces = [_patches(latent.to(device, compute), patch) for latent in latents]
    shapes = [grid for _, grid in pieces]
    hidden = torch.cat([tokens for tokens, _ in pieces], dim=1)
    with torch.no_grad():
        out = model(hidden, timestep.reshape(-1).expand(batch).to(device), context.to(device, compute).expand(
            batch, *context.shape[1:]), shape_list=[shapes] * batch, return_dict=False)[0]
    frames, rows, cols = shapes[0]
    out = out[:, :frames * rows * cols].reshape(batch, frames, rows, cols, out.shape[2], *patch)
    out = out.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(batch, -1, frames * patch[0], rows * patch[1], cols * patch[2])
    return out[:, :, :x.shape[2], :x.shape[3], :x.shape[4]].to(x.dtype).cpu()


def plus_model(model: torch.nn.Module) -> torch.nn.Module:
    """diffusers' Edit-Plus class (the model ComfyUI's JoyImage is) holding the loaded model's weights."""
    from diffusers import JoyImageEditPlusTransformer3DModel
    plus = JoyImageEditPlusTransformer3DModel.from_config(dict(model.config))
    plus.load_state_dict(model.state_dict())
    weight = model.proj_out.weight
    if (weight.device.type, weight.dtype) != ("cpu", torch.float32):
        plus = plus.to(weight.device, weight.dtype)
    return plus.eval()


def _patches(latent: torch.Tensor, patch: tuple[int, int, int]):
    """[B, C, T, H, W] -> ([B, n, C, pt, ph, pw] in (t, h, w) token order, (t, h, w) patch grid), padded circularly."""
    pads = [(-size) % p for size, p in zip(latent.shape[2:], patch)]
    if any(pads):
        latent = F.pad(latent, (0, pads[2], 0, pads[1], 0, pads[0]), mode="circular")
    batch, channels = latent.shape[:2]
    grid = tuple(size // p for size, p in zip(latent.shape[2:], patch))
    tokens = latent.reshape(batch, channels, grid[0], patch[0], grid[1], patch[1], grid[2], patch[2])
    tokens = tokens.permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(batch, math.prod(grid), channels, *patch)
    return tokens, grid
