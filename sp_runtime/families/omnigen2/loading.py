"""OmniGen2's model: diffusers' Lumina2Transformer2DModel (ComfyUI's OmniGen2 blocks, embedders and head have its
structure and names) with what OmniGen2 adds: the reference images' patch embedder, refiner and index embedding,
and ComfyUI's timestep scale (sinusoids of 1000 t)."""
from __future__ import annotations

import torch

from ...checkpoints.loading import WeightDtypes, build_empty_model
from .detection import REFERENCE_SLOTS, TIMESTEP_SCALE

LUMINA2_KEYS = ("patch_size", "in_channels", "hidden_size", "num_layers", "num_refiner_layers",
                "num_attention_heads", "num_kv_heads", "multiple_of", "ffn_dim_multiplier", "cap_feat_dim",
                "axes_dim_rope", "axes_lens")


def build_model(model_class, config: dict, dtypes: WeightDtypes):
    """The empty model (meta weights) of a detection's config. The added modules are built after diffusers'
    layerwise casting is set up, so fp8 files keep them in the compute dtype (two blocks and two Linears)."""
    from accelerate import init_empty_weights
    model = build_empty_model(model_class, {key: config[key] for key in LUMINA2_KEYS}, dtypes)
    with init_empty_weights():
        add_reference_modules(model)
    return model


def add_reference_modules(model) -> None:
    """ref_image_patch_embedder, ref_image_refiner (modulated blocks, as many as noise_refiner) and
    image_index_embedding (one row per reference slot) on a Lumina2Transformer2DModel; the time sinusoids scaled."""
    config, block = model.config, type(model.noise_refiner[0])
    model.ref_image_patch_embedder = torch.nn.Linear(model.x_embedder.in_features, config.hidden_size)
    model.ref_image_refiner = torch.nn.ModuleList(
        block(config.hidden_size, config.num_attention_heads, config.num_kv_heads, config.multiple_of,
              config.ffn_dim_multiplier, config.norm_eps, modulation=True) for _ in range(config.num_refiner_layers))
    model.image_index_embedding = torch.nn.Parameter(torch.zeros(REFERENCE_SLOTS, config.hidden_size))
    model.time_caption_embed.time_proj.scale = TIMESTEP_SCALE
