"""Qwen-Image loading: diffusers' QwenImageTransformer2DModel with the checkpoint's weights (load options: variant,
axes_dims_rope), and the worker running PLAN."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from ...checkpoints.header import Header
from ...checkpoints.loading import ProgressFn, WeightDtypes, detected_checkpoint, load_checkpoint_model, strip_prefix
from ...contract import Detection, ModelInfo, config_entries
from ...sp import PlanWorker
from ..family import pool_load
from .detection import (CONFIG_KEYS, EDIT_2511_MARKER, NAME, PATCH, VARIANT_EDIT_2511, VARIANT_IMAGE,
                        VARIANT_LAYERED, detect)
from .keys import weight_plan
from .plan import PLAN


def load_model(path: str, dtype: str = "default", device: torch.device | str = "cpu",
               detection: Optional[Detection] = None, options: Optional[dict] = None,
               progress: Optional[ProgressFn] = None, header: Optional[Header] = None
               ) -> tuple[torch.nn.Module, Detection, WeightDtypes]:
    """A diffusers QwenImageTransformer2DModel with the checkpoint's weights (stock attention processors)."""
    from diffusers import QwenImageTransformer2DModel

    header, detection = detected_checkpoint(path, header, detection, detect, NAME, "Qwen-Image")
    detection = _with_options(detection, options or {})
    plan = weight_plan(detection, strip_prefix(header.tensors, detection.prefix))
    model, dtypes = load_checkpoint_model(QwenImageTransformer2DModel, detection.config,
                                          header, detection, dtype, device, plan, progress, ignore=(EDIT_2511_MARKER,))
    return model, detection, dtypes


def _with_options(detection: Detection, options: dict) -> Detection:
    """Apply load options: variant="edit_2511" (files that cannot say so), axes_dims_rope (unusual head sizes)."""
    config = dict(detection.config)
    if "axes_dims_rope" in options:
        config["axes_dims_rope"] = tuple(options["axes_dims_rope"])
    variant = options.get("variant") or detection.variant
    if variant not in (VARIANT_IMAGE, VARIANT_EDIT_2511, VARIANT_LAYERED):
        raise ValueError(f"Qwen-Image variant {variant!r} is unknown; use {VARIANT_IMAGE!r} or {VARIANT_EDIT_2511!r}")
    if (variant == VARIANT_LAYERED) != (detection.variant == VARIANT_LAYERED):
        raise ValueError(f"variant {variant!r} does not fit this {detection.variant!r} file: Qwen-Image-Layered is "
                         f"told by its weights (time_text_embed.addition_t_embedding), not by an option")
    config["zero_cond_t"] = variant == VARIANT_EDIT_2511
    return replace(detection, variant=variant, config=config)




def worker_from_model(model, detection: Detection, dtypes: WeightDtypes, options: Optional[dict] = None
                      ) -> PlanWorker:
    """The worker around a built model (load(), synthetic models): the executor running PLAN."""
    return PlanWorker(model, model_info(model, detection, dtypes), PLAN, dtypes, options)


def model_info(model, detection: Detection, dtypes: WeightDtypes) -> ModelInfo:
    config = model.config
    return ModelInfo(family=NAME, variant=detection.variant, in_channels=config.in_channels // (PATCH * PATCH),
                     out_channels=config.out_channels, x_ndim=5,
                     config=config_entries(config, CONFIG_KEYS),
                     weight_dtype=dtypes.storage_name, compute_dtype=dtypes.compute_name)


load = pool_load(load_model, worker_from_model)
