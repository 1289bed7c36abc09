"""MiniMax H3 loading: diffusers' MiniMaxH3Transformer3DModel with the checkpoint's weights; a pruned file's curve
table in place of the time embedder (CurveTime), a FastH3 file's bank of output heads in place of the two heads;
MODEL declares the load and the worker running PLAN."""
from __future__ import annotations

import torch

from ...checkpoints.loading import WeightDtypes, build_empty_model
from ..family import PlanModel
from .detection import MODEL_KEYS, NAME, PATCH, detect
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


def build_model(model_class, config: dict, dtypes: WeightDtypes):
    """The empty model of a detection's config (meta weights), with the curve embedder / head bank it needs and each
    attention's rotary channel order (plan.project_pairs)."""
    model = build_empty_model(model_class, {key: config[key] for key in MODEL_KEYS}, dtypes)
    if config["adaln_curve_grid"]:
        model.time_proj = torch.nn.Identity()
        model.time_embedder = CurveTime(config["adaln_curve_grid"], config["time_embed_dim"])
    heads = config["pdd_heads"]
    if heads > 1:
        model.proj_out = torch.nn.Linear(config["hidden_size"], heads * model.proj_out.out_features, device="meta")
        model.audio_proj_out = torch.nn.Linear(config["hidden_size"], heads * config["audio_in_channels"],
                                               device="meta")
    pairs = rotary_pairs(config["attention_head_dim"], 6 * config["rope_freq_dim"])
    for block in model.transformer_blocks:
        block.attn.rotary_pairs = pairs
    return model


def describe(model, detection) -> dict:
    """What the host reads beyond diffusers' config: the curve grid, the head bank, the patch and the inputs passed
    whole (not split by batch)."""
    return {"adaln_curve_grid": detection.config["adaln_curve_grid"], "pdd_heads": detection.config["pdd_heads"],
            "patch_size": list(PATCH),
            "unbatched_inputs": ["latent_shapes", "keyframe_latents", "keyframe_frames", "sample_sigmas",
                                 "references", "text_token_tags", "keyframe_audio_latents", "keyframe_audio_frames"]}


MODEL = PlanModel(NAME, "MiniMax H3", "MiniMaxH3Transformer3DModel", detect, weight_plan, PLAN, 3, MODEL_KEYS,
                  channels=lambda model: (1, 1), ignore=UNUSED, build=build_model, describe=describe)
load, load_model = MODEL.load, MODEL.load_model
