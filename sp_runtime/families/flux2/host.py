"""How ComfyUI's host side sees Flux.2: one model class, its unet_config and the unpatched latent."""
from __future__ import annotations

from ...contract import ComfyHost, HostHooks, latent_channels
from .detection import PATCH


COMFY = ComfyHost(model_classes={"": "Flux2"},
                  unet_config=lambda info: {"image_model": "flux2", **latent_channels(info), "patch_size": PATCH},
                  attributes=lambda info: {"patch_size": PATCH}, hooks=HostHooks(rope_options="applied"))
