"""Qwen-Image with InstantX ControlNets on one device (tests): diffusers' QwenImageControlNetModel computes each
ControlNet's block samples (rotary looked up at ComfyUI's ids, no text mask: ComfyUI gives the ControlNet none),
ComfyUI's loader spreads them over 60 main-model blocks, the chain is summed, and diffusers' Qwen-Image forward adds
them to x's tokens."""
from __future__ import annotations

import math

import torch

from sp_runtime.families.qwen_image import PATCH, as_4d
from sp_runtime.sp.tokens import TokenGrid, grid_ids, reference_pack
from sp_lab.references.qwen_image import _ComfyPositions, reference_forward

MAIN_MODEL_BLOCKS = 60


def controlnet_samples(net, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor, hint: torch.Tensor,
                       strength: float) -> list[torch.Tensor]:
    """The ControlNet's residual per main-model block (60, ComfyUI's repeat), times the strength."""
    compute, device = net.img_in.weight.dtype, net.img_in.weight.device
    latent = as_4d(x, "x")
    batch = latent.shape[0]
    tokens, grid = reference_pack(latent.to(device, compute), PATCH)
    cond, _ = reference_pack(as_4d(hint, "hint").expand(batch, -1, -1, -1).to(device, compute), PATCH)
    grid = TokenGrid.of(*latent.shape[-2:], PATCH)
    ids = grid_ids(grid, 0, 0, 0, True, x.dtype, device)
    saved, net.pos_embed = net.pos_embed, _ComfyPositions(net.pos_embed, ids, max(grid.rows // 2, grid.cols // 2))
    try:
        with torch.no_grad():
            samples = net(hidden_states=tokens, controlnet_cond=cond, conditioning_scale=strength,
                          encoder_hidden_states=context.to(device, compute),
                          timestep=timestep.reshape(-1).expand(batch).to(device, compute),
                          img_shapes=[[(1, grid.rows, grid.cols)]] * batch, return_dict=False)
    finally:
        net.pos_embed = saved
    repeat = math.ceil(MAIN_MODEL_BLOCKS / len(samples))
    return [samples[index // repeat] for index in range(MAIN_MODEL_BLOCKS)]


def reference_forward_controlled(model, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                                 controlnets, **inputs) -> torch.Tensor:
    """Qwen-Image's reference forward with the ControlNets [(net, hint, strength), ...] (chain order) added."""
    total = None
    for net, hint, strength in controlnets:
        samples = controlnet_samples(net, x, timestep, context, hint, strength)
        total = samples if total is None else [a + b for a, b in zip(total, samples)]
    return reference_forward(model, x, timestep, context, controlnet_block_samples=total, **inputs)
