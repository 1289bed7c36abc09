"""How ComfyUI's host side sees LTX-Video 0.9: its LTXV model class, what it reads from `diffusion_model` (the
patchifier its process_timestep uses to make the denoise mask's per-token sigmas) and the host hook that keeps the
denoise mask (already in those sigmas) on the host and refuses LTXVAddGuide's attention weights by name."""
from __future__ import annotations

from ...contract import ComfyHost, HostHooks, ModelInfo
from ..ltx2.host import PATCHIFIERS, VAE_SCALE_FACTORS, check_guides, guide_weights


def comfy_attributes(info: ModelInfo) -> dict:
    config = info.config
    return {"patch_size": 1, "vae_scale_factors": VAE_SCALE_FACTORS,
            "causal_temporal_positioning": config["causal_temporal_positioning"],
            "inner_dim": config["num_attention_heads"] * config["attention_head_dim"]}


class DenoiseMaskOnHost(HostHooks):
    """ComfyUI's LTXV call as the pool's: the denoise mask stays on the host (the timestep carries it per token);
    guides run as tokens at keyframe_idxs, without an attention mask."""

    def pack(self, x, timestep, inputs: dict) -> tuple:
        check_guides(inputs)
        if guide_weights(inputs.get("guide_attention_entries"), x.shape[0]) is not None:
            raise ValueError("LTX-Video guides with a strength below 1 or an attention mask (LTXVAddGuide's guide "
                             "attention) are not supported under sequence parallelism yet; use strength 1")
        return x, timestep, {key: value for key, value in inputs.items()
                             if key not in ("denoise_mask", "guide_attention_entries")}


COMFY = ComfyHost(model_classes={"": "LTXV"}, unet_config=lambda info: {"image_model": "ltxv"},
                  attributes=comfy_attributes,
                  helpers={"patchifier": (PATCHIFIERS, "SymmetricPatchifier", (1,), {})}, hooks=DenoiseMaskOnHost())
