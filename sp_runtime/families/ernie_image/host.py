"""How ComfyUI's host side sees ERNIE-Image: its ErnieImage model class (supported_models.ErnieImage: a FLOW model of
multiplier 1000, the Flux.2 latent format), whose detection reads no sizes."""
from __future__ import annotations

from ...contract import ComfyHost

COMFY = ComfyHost(model_classes={"": "ErnieImage"}, unet_config=lambda info: {"image_model": "ernie"},
                  attributes=lambda info: {"patch_size": info.config["patch_size"]})
