"""How ComfyUI's host side sees Chroma: ComfyUI's Chroma model class (Flux's latent format and 2x2 patches)."""
from __future__ import annotations

from ...contract import ComfyHost, latent_channels


COMFY = ComfyHost(model_classes={"": "Chroma"},
                  unet_config=lambda info: {"image_model": "chroma", **latent_channels(info)})
