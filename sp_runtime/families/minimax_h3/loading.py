"""MiniMax H3 loading: diffusers' MiniMaxH3Transformer3DModel with the checkpoint's weights; a pruned file's curve
table in place of the time embedder (CurveTime), a FastH3 file's bank of output heads in place of the two heads;
and the worker running PLAN."""
from __future__ import annotations

from typing import Optional

import torch

from ...checkpoints.header import Header
from ...checkpoints.loading import (ProgressFn, WeightDtypes, build_empty_model, choose_dtypes, detected_checkpoint,
                                    load_weights, strip_prefix)
from ...contract import Detection, ModelInfo, config_entries
from ...sp import PlanWorker
from ..family import pool_load
from .detection import CONFIG_KEYS, MODEL_KEYS, NAME, PATCH, detect
from .keys import UNUSED, weight_plan
from .plan import PLAN, rotary_pairs


class CurveTime(torch.nn.Module):
    """The pruned files' time embedding (ComfyUI's adaln curves): t in [0, 1] -> its row of `table`, linearly
    interpolated between grid rows; the AdaLN projections read it without an activation."""

    def __init__(self, grid: int, width: int):
        super().__init__()
        self.table = torch.nn.Parameter(torch.zeros(grid, width), requires_grad=False)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        table = self.table
        position = t.to(table.dtype).clamp(0.0, 1.0) * (table.shape[0] - 1)
        lower = position.floor().long().clamp(max=table.shape[0] - 2)
        return torch.lerp(table[lower], table[lower + 1], (position - lower).unsqueeze(1))


def build_model(config: dict, dtypes: WeightDtypes):
    """The empty model of a detection's config (meta weights), with the curve embedder / head bank it needs."""
    from diffusers import MiniMaxH3Transformer3DModel
    model = build_empty_model(MiniMaxH3Transformer3DModel, {key: config[key] for key in MODEL_KEYS}, dtypes)
    if config["adaln_curve_grid"]:
        model.time_proj = torch.nn.Identity()
        model.time_embedder = CurveTime(config["adaln_curve_grid"], config["time_embed_dim"])
    heads = config["pdd_heads"]
    if heads > 1:
        model.proj_out = torch.nn.Linear(config["hidden_size"], heads * model.proj_out.out_features, device="meta")
        model.audio_proj_out = torch.nn.Linear(config["hidden_size"], heads * config["audio_in_channels"],
                                               device="meta")
    return model


def load_model(path: str, dtype: str = "default", device: torch.device | str = "cpu",
               detection: Optional[Detection] = None, options: Optional[dict] = None,
               progress: Optional[ProgressFn] = None, header: Optional[Header] = None
               ) -> tuple[torch.nn.Module, Detection, WeightDtypes]:
    header, detection = detected_checkpoint(path, header, detection, detect, NAME, "MiniMax H3")
    keys = strip_prefix(header.tensors, detection.prefix)
    dtypes = choose_dtypes(dtype, header, detection.prefix)
    model = build_model(detection.config, dtypes)
    load_weights(model, header.source, device=device, dtypes=dtypes, prefix=detection.prefix,
                 plan=weight_plan(detection, keys), ignore=[key for key in keys if key.endswith(UNUSED)],
                 progress=progress)
    return model, detection, dtypes


def worker_from_model(model, detection: Detection, dtypes: WeightDtypes, options: Optional[dict] = None
                      ) -> PlanWorker:
    config = detection.config
    pairs = rotary_pairs(config["attention_head_dim"], 6 * config["rope_freq_dim"]).to(model.proj_in.weight.device)
    for block in model.transformer_blocks:
        block.attn.rotary_pairs = pairs
    info = ModelInfo(family=NAME, variant=detection.variant, in_channels=1, out_channels=1, x_ndim=3,
                     config={**config_entries(config, CONFIG_KEYS), "patch_size": list(PATCH),
                             "unbatched_inputs": ["latent_shapes", "keyframe_latents", "keyframe_frames",
                                                  "sample_sigmas"]},
                     weight_dtype=dtypes.storage_name, compute_dtype=dtypes.compute_name)
    return PlanWorker(model, info, PLAN, dtypes, options)


load = pool_load(load_model, worker_from_model)
