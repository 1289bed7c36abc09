"""Tiny random-weight Boogu-Image models (sp_runtime.families.boogu.modules' model: 6 query heads over 2 key / value
heads of size 12, 1 refiner block per stream, 1 double-stream and 2 single-stream blocks, 16 latent channels). ComfyUI's
files use the model's own key names, so it is saved as built."""
from __future__ import annotations

import torch

from .weights import randomize_, sized

BOOGU_TINY = dict(patch_size=2, in_channels=16, hidden_size=72, num_layers=2, num_double_stream_layers=1,
                  num_refiner_layers=1, num_attention_heads=6, num_kv_heads=2, multiple_of=256,
                  ffn_dim_multiplier=None, norm_eps=1e-5, cap_feat_dim=40, axes_dim_rope=(4, 4, 4),
                  axes_lens=(2048, 1664, 1664))


def tiny_config(**size) -> dict:
    return sized("boogu", BOOGU_TINY, size)


def build_tiny_model(seed: int = 0, **size) -> torch.nn.Module:
    """The float32 model as the loader builds it (diffusers' Lumina 2 model with Boogu's modules), seeded weights."""
    from diffusers import Lumina2Transformer2DModel
    from sp_runtime.families.boogu.detection import LUMINA2_KEYS
    from sp_runtime.families.boogu.modules import add_boogu_modules
    config = tiny_config(**size)
    model = Lumina2Transformer2DModel.from_config({key: config[key] for key in LUMINA2_KEYS})
    add_boogu_modules(model, config)
    randomize_(model, seed)
    return model.eval().requires_grad_(False)


def original_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """ComfyUI's names: the model's own."""
    return {key: value.detach() for key, value in model.state_dict().items()}
