"""Chroma loading: diffusers' ChromaTransformer2DModel with the checkpoint's weights, and the worker running PLAN."""
from __future__ import annotations

from typing import Optional

import torch

from ...checkpoints.header import Header
from ...checkpoints.loading import (ProgressFn, WeightDtypes, detected_checkpoint, load_checkpoint_model,
                                    strip_prefix)
from ...contract import Detection, ModelInfo, config_entries
from ...sp import PlanWorker
from ..family import pool_load
from .detection import CONFIG_KEYS, NAME, detect
from .keys import weight_plan
from .plan import PATCH, PLAN


def load_model(path: str, dtype: str = "default", device: torch.device | str = "cpu",
               detection: Optional[Detection] = None, options: Optional[dict] = None,
               progress: Optional[ProgressFn] = None, header: Optional[Header] = None
               ) -> tuple[torch.nn.Module, Detection, WeightDtypes]:
    """A diffusers ChromaTransformer2DModel with the checkpoint's weights (stock attention processors)."""
    from diffusers import ChromaTransformer2DModel
    header, detection = detected_checkpoint(path, header, detection, detect, NAME, "Chroma")
    plan = weight_plan(detection, strip_prefix(header.tensors, detection.prefix))
    model, dtypes = load_checkpoint_model(ChromaTransformer2DModel, detection.config, header, detection, dtype,
                                          device, plan, progress)
    return model, detection, dtypes


def worker_from_model(model, detection: Detection, dtypes: WeightDtypes, options: Optional[dict] = None
                      ) -> PlanWorker:
    config = model.config
    info = ModelInfo(family=NAME, variant=detection.variant, in_channels=config.in_channels // (PATCH * PATCH),
                     out_channels=model.proj_out.out_features // (PATCH * PATCH), x_ndim=4,
                     config=config_entries(config, CONFIG_KEYS), weight_dtype=dtypes.storage_name,
                     compute_dtype=dtypes.compute_name)
    return PlanWorker(model, info, PLAN, dtypes, options)


load = pool_load(load_model, worker_from_model)
