"""How ComfyUI's host side sees Chroma: ComfyUI's Chroma model class (Flux's latent format and 2x2 patches);
Chroma Radiance's ChromaRadiance (pixel space: 3 channels, ComfyUI's ChromaRadiance latent format, P x P patches)."""
from __future__ import annotations

from ...contract import ComfyHost, latent_channels


def _unet_config(info) -> dict:
    radiance = info.variant == "radiance"
    return {"image_model": "chroma_radiance" if radiance else "chroma", **latent_channels(info),
            **({"patch_size": info.config["pixel_patch"]} if radiance else {})}


def _attributes(info) -> dict:
    return {"patch_size": info.config["pixel_patch"] if info.variant == "radiance" else 2}


COMFY = ComfyHost(model_classes={"": "Chroma", "radiance": "ChromaRadiance"}, unet_config=_unet_config,
                  attributes=_attributes)
