"""HunyuanVideo 1.5 loading: diffusers' HunyuanVideo15Transformer3DModel with the checkpoint's weights, and the
worker running PLAN."""
from __future__ import annotations

from typing import Optional

import torch

from ...checkpoints.header import Header
from ...checkpoints.loading import ProgressFn, WeightDtypes, detected_checkpoint, load_checkpoint_model, strip_prefix
from ...contract import Detection
from ...sp import PlanWorker
from ..family import pool_load
from ..hunyuan_video import model_info
from .detection import CONFIG_KEYS, NAME, detect
from .keys import weight_plan
from .plan import PLAN


def load_model(path: str, dtype: str = "default", device: torch.device | str = "cpu",
               detection: Optional[Detection] = None, options: Optional[dict] = None,
               progress: Optional[ProgressFn] = None, header: Optional[Header] = None
               ) -> tuple[torch.nn.Module, Detection, WeightDtypes]:
    """A diffusers HunyuanVideo15Transformer3DModel with the checkpoint's weights (stock attention processors)."""
    from diffusers import HunyuanVideo15Transformer3DModel

    header, detection = detected_checkpoint(path, header, detection, detect, NAME, "HunyuanVideo 1.5")
    plan = weight_plan(detection, strip_prefix(header.tensors, detection.prefix))
    model, dtypes = load_checkpoint_model(HunyuanVideo15Transformer3DModel, detection.config, header, detection,
                                          dtype, device, plan, progress)
    return model, detection, dtypes


def worker_from_model(model, detection: Detection, dtypes: WeightDtypes, options: Optional[dict] = None
                      ) -> PlanWorker:
    return PlanWorker(model, model_info(model, detection, dtypes, CONFIG_KEYS), PLAN, dtypes, options)


load = pool_load(load_model, worker_from_model)
