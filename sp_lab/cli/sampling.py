"""The workload of the demo and the benchmark: seeded latents and conditioning shaped as ComfyUI passes them to
`diffusion_model(x, t, context=..., **extra)`, a flow-matching sigma schedule and the Euler loop of ComfyUI's
KSampler ("euler" sampler) on a velocity model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .presets import latent_shape, token_count

FLUX_GUIDANCE = 3.5  # ComfyUI's FluxGuidance default
Forward = Callable[[torch.Tensor, torch.Tensor, dict], torch.Tensor]


def flow_sigmas(steps: int, shift: float = 3.0) -> torch.Tensor:
    """steps + 1 sigmas from 1 to 0, time-shifted as ComfyUI's ModelSamplingSD3 / AuraFlow (shift 3)."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    t = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    return (shift * t / (1 + (shift - 1) * t)).float()


def model_timestep(family: str, sigma: float, batch: int) -> torch.Tensor:
    """What ComfyUI passes as t: sigma for Qwen-Image and Flux, sigma x 1000 for Wan."""
    return torch.full((batch,), float(sigma) * (1000.0 if family == "wan" else 1.0), dtype=torch.float32)


@dataclass
class Workload:
    """One generation's inputs: the initial noise and the conditioning of every model call."""

    family: str
    noise: torch.Tensor
    conditioning: dict
    text_tokens: int

    @property
    def tokens(self) -> int:
        return token_count(self.family, tuple(self.noise.shape))

    @property
    def batch(self) -> int:
        return self.noise.shape[0]

    def describe(self) -> dict:
        return {"latent_shape": list(self.noise.shape), "image_tokens": self.tokens, "text_tokens": self.text_tokens,
                "batch": self.batch, "dtype": str(self.noise.dtype).removeprefix("torch.")}


def make_workload(family: str, info_config: dict, in_channels: int, width: int, height: int, frames: int = 1,
                  batch: int = 1, text_tokens: int = 32, seed: int = 0,
                  dtype: torch.dtype = torch.float32) -> Workload:
    """Seeded noise and conditioning for a model described by its ModelInfo (family, config, in_channels)."""
    if family == "wan" and in_channels != 16 and in_channels != 48:
        raise ValueError(f"this Wan checkpoint takes {in_channels} input channels (an image-to-video model); the "
                         f"demo and benchmark build text-to-video inputs only (16 or 48 channels)")
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(latent_shape(family, in_channels, width, height, frames, batch), generator=generator)
    text_width = info_config["text_dim" if family == "wan" else "joint_attention_dim"]
    conditioning = {"context": torch.randn(batch, text_tokens, text_width, generator=generator)}
    if family == "flux":
        conditioning["y"] = torch.randn(batch, info_config["pooled_projection_dim"], generator=generator)
        if info_config.get("guidance_embeds"):
            conditioning["guidance"] = torch.full((batch,), FLUX_GUIDANCE)
    return Workload(family, noise.to(dtype), {k: v.to(dtype) for k, v in conditioning.items()}, text_tokens)


def euler_loop(forward: Forward, workload: Workload, sigmas: torch.Tensor,
               on_step: Optional[Callable[[int, float, float, torch.Tensor], None]] = None) -> torch.Tensor:
    """x_{i+1} = x_i + (sigma_{i+1} - sigma_i) * v(x_i, sigma_i), from x_0 = noise (an empty latent at sigma 1).

    forward(x, t, conditioning) returns the model's velocity; on_step(i, sigma, sigma_next, velocity) after each step.
    """
    x = workload.noise.clone()
    for index in range(len(sigmas) - 1):
        sigma, sigma_next = float(sigmas[index]), float(sigmas[index + 1])
        velocity = forward(x, model_timestep(workload.family, sigma, workload.batch), workload.conditioning)
        x = x + (sigma_next - sigma) * velocity.to(x.dtype)
        if on_step is not None:
            on_step(index, sigma, sigma_next, velocity)
    return x
