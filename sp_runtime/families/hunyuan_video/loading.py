"""HunyuanVideo 1.0 loading: diffusers' HunyuanVideoTransformer3DModel (with token-replace blocks) with the
checkpoint's weights, and the worker running PLAN."""
from __future__ import annotations

from typing import Optional

import torch

from ...checkpoints.header import Header
from ...checkpoints.loading import ProgressFn, WeightDtypes, detected_checkpoint, load_checkpoint_model, strip_prefix
from ...contract import Detection, ModelInfo, config_entries
from ...sp import PlanWorker
from ..family import pool_load
from .detection import CONFIG_KEYS, NAME, detect
from .keys import weight_plan
from .plan import PLAN


def load_model(path: str, dtype: str = "default", device: torch.device | str = "cpu",
               detection: Optional[Detection] = None, options: Optional[dict] = None,
               progress: Optional[ProgressFn] = None, header: Optional[Header] = None
               ) -> tuple[torch.nn.Module, Detection, WeightDtypes]:
    """A diffusers HunyuanVideoTransformer3DModel with the checkpoint's weights, built with token-replace blocks
    (the same weights as the plain blocks; with no token to replace they compute the plain blocks)."""
    from diffusers import HunyuanVideoTransformer3DModel

    header, detection = detected_checkpoint(path, header, detection, detect, NAME, "HunyuanVideo 1.0")
    config = {**detection.config, "image_condition_type": "token_replace"}
    plan = weight_plan(detection, strip_prefix(header.tensors, detection.prefix))
    model, dtypes = load_checkpoint_model(HunyuanVideoTransformer3DModel, config, header, detection, dtype, device,
                                          plan, progress)
    return model, detection, dtypes


def worker_from_model(model, detection: Detection, dtypes: WeightDtypes, options: Optional[dict] = None
                      ) -> PlanWorker:
    return PlanWorker(model, model_info(model, detection, dtypes), PLAN, dtypes, options)


def model_info(model, detection: Detection, dtypes: WeightDtypes, config_keys=CONFIG_KEYS) -> ModelInfo:
    """What the host needs of a loaded HunyuanVideo (1.0 or 1.5: its own config keys)."""
    config = model.config
    return ModelInfo(family=detection.family, variant=detection.variant, in_channels=config.in_channels,
                     out_channels=config.out_channels, x_ndim=5, config=config_entries(config, config_keys),
                     weight_dtype=dtypes.storage_name, compute_dtype=dtypes.compute_name)


load = pool_load(load_model, worker_from_model)
