"""How ComfyUI's host side sees HunyuanVideo 1.5: its model classes (the SR model's own), 1.0's attributes, and the
SR model's sampler input (the next sigma, read from the sampler's state on the host)."""
from __future__ import annotations

import torch

from ...contract import ComfyHost, HostHooks, latent_channels
from ..hunyuan_video.host import comfy_attributes
from .detection import SR


def sampler_inputs(transformer_options: dict, inputs: dict) -> dict:
    """ComfyUI's meanflow step, read on the host: `timestep_r` = the sampler's sigma after the current one, x 1000
    (ComfyUI's time_r_in embeds it with time factor 1000; a 0-D tensor, for every batch item), where ComfyUI's
    model would use it: the current sigma is in the schedule and the call does not set disable_time_r. Models
    without time_r_in ignore it."""
    sigmas, schedule = transformer_options.get("sigmas"), transformer_options.get("sample_sigmas")
    if inputs.get("disable_time_r") or sigmas is None or schedule is None:
        return {}
    found = torch.where(sigmas[0] == schedule)[0]
    if len(found) == 0:
        return {}
    return {"timestep_r": (schedule[found[0] + 1] * 1000).to(torch.float32)}  # 0-D: one value for the batch



class SamplerSigma(HostHooks):
    """The host hook of HunyuanVideo 1.5: sampler_inputs on every call; rope_options ignored, as ComfyUI does."""

    rope_options = "ignored"

    def call_inputs(self, transformer_options: dict, inputs: dict) -> dict:
        return sampler_inputs(transformer_options, inputs)


COMFY = ComfyHost(model_classes={SR: "HunyuanVideo15_SR_Distilled", "": "HunyuanVideo15"},
                  unet_config=lambda info: {**latent_channels(info), "vision_in_dim": info.config["image_embed_dim"]},
                  attributes=comfy_attributes, hooks=SamplerSigma())
