"""NewBie (a Lumina 2 NextDiT with pooled Jina CLIP text): the two modules diffusers' Lumina2Transformer2DModel lacks,
under ComfyUI's names, and the time embedding they make. ComfyUI's facts: clip_text_pooled_proj = RMSNorm(width,
eps 1e-5) then Linear(width, width); time_text_embed = SiLU then Linear(time + width, time), time = min(dim, 1024);
every modulation reads time_text_embed([t_embedder(t), clip_text_pooled_proj(pooled)]), zeros for the pooled half
when the call has none (not projected)."""
from __future__ import annotations

import torch

from ...checkpoints.loading import WeightDtypes, build_empty_model

NORM_EPS = 1e-5  # NextDiT's norm_eps


def build_model(model_class, config: dict, dtypes: WeightDtypes):
    """The empty Lumina 2 model of a detection's config; NewBie's (clip_text_dim in the config) with its modules."""
    width = config.get("clip_text_dim")
    model = build_empty_model(model_class, {key: value for key, value in config.items() if key != "clip_text_dim"},
                              dtypes)
    if width:
        add_newbie_modules(model, width, device="meta")
    return model


def add_newbie_modules(model, width: int, device=None) -> None:
    time = min(model.config.hidden_size, 1024)
    model.clip_text_pooled_proj = torch.nn.Sequential(torch.nn.RMSNorm(width, eps=NORM_EPS, device=device),
                                                      torch.nn.Linear(width, width, device=device))
    model.time_text_embed = torch.nn.Sequential(torch.nn.SiLU(), torch.nn.Linear(time + width, time, device=device))


def is_newbie(model) -> bool:
    return getattr(model, "time_text_embed", None) is not None


def with_pooled_text(model, time: torch.Tensor, pooled) -> torch.Tensor:
    """NewBie's modulation input from the time embedding [B, time] and the pooled text [B or 1, width] (or None)."""
    width = model.clip_text_pooled_proj[1].in_features
    if pooled is None:
        pooled = time.new_zeros(time.shape[0], width)
    else:
        pooled = model.clip_text_pooled_proj(pooled.to(time.dtype)).expand(time.shape[0], -1)
    return model.time_text_embed(torch.cat([time, pooled], dim=-1))
