"""How ComfyUI's host side sees Krea 2: its Krea2 model class (supported_models.Krea2, Wan 2.1's latent format)."""
from __future__ import annotations

from ...contract import ComfyHost

COMFY = ComfyHost(model_classes={"": "Krea2"}, unet_config=lambda info: {"image_model": "krea2"})
