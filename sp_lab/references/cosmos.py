"""Cosmos-Predict2's single-device reference (tests): diffusers' stock forward, fed ComfyUI's call."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from sp_runtime.families.cosmos import load_model
from sp_lab.references import as_model


def reference_forward(model_or_path, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                      dtype: str = "default", **_ignored) -> torch.Tensor:
    """ComfyUI's MiniTrainDIT(x, timesteps, context) by diffusers' forward: the timestep as it comes, an all-zero
    padding mask, the latent padded to whole patches by wrap-around (ComfyUI's pad_to_patch_size) and cropped back."""
    _without_torchvision()
    model = as_model(model_or_path, load_model, dtype)
    weight = model.patch_embed.proj.weight
    compute, device = weight.dtype, weight.device
    height, width = x.shape[-2:]
    padded = torch.cat([x, x[:, :, :, :height % 2]], dim=3)
    padded = torch.cat([padded, padded[:, :, :, :, :width % 2]], dim=4)
    context = context.expand(x.shape[0], -1, -1).to(device, compute)
    timestep = timestep.reshape(-1).expand(x.shape[0]).float().to(device)
    padding_mask = torch.zeros(1, 1, *padded.shape[-2:], device=device, dtype=compute)
    with torch.no_grad():
        out = model(padded.to(device, compute), timestep, context, padding_mask=padding_mask, return_dict=False)[0]
    return out[:, :, :, :height, :width].to(x.dtype).cpu()


def _without_torchvision() -> None:
    """diffusers' Cosmos forward resizes the padding mask with torchvision, which this environment may lack: a
    same-size nearest resize (all the reference needs) stands in for it."""
    from diffusers.models.transformers import transformer_cosmos
    if not hasattr(transformer_cosmos, "transforms"):
        resize = lambda mask, size, interpolation=None: torch.nn.functional.interpolate(mask, size=size)  # noqa: E731
        transformer_cosmos.transforms = SimpleNamespace(functional=SimpleNamespace(resize=resize),
                                                        InterpolationMode=SimpleNamespace(NEAREST=None))
