"""Loading a Wan checkpoint into diffusers' WanTransformer3DModel (or a variant's class, with its extra modules
attached) and the worker around it: the executor running the plan of the model's variants."""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from ...sp import PlanWorker
from ...contract import Detection, ModelInfo, config_entries
from ...checkpoints.loading import (KeyPlan, ProgressFn, WeightDtypes, build_empty_model, choose_dtypes,
                                    detected_checkpoint, load_weights, original_layout_plan)
from ...checkpoints.header import Header, header_config
from ..family import pool_load
from .detect import (DEFAULT_HEAD_DIM, DIFFUSERS_IGNORED_SUFFIX, FAMILY, HEAD_DIM_METADATA_KEY, detect,
                     folder_overrides)
from .keys import wan_key_plan
from .plan import plan_for
from .variants import REGISTRY, variants_of

INFO_KEYS = ("patch_size", "num_layers", "text_dim", "ffn_dim", "freq_dim", "image_dim", "pos_embed_seq_len")


def extra_module_keys() -> tuple[str, ...]:
    """Config entries of the variants that are not diffusers' arguments (their attach() takes them)."""
    return tuple(key for variant in REGISTRY for key in variant.config_keys)


def original_plan(keys: Iterable[str], config) -> KeyPlan:
    """Original (Wan / ComfyUI) key names -> parameters (LoRAs use these names too); the same for every size."""
    return wan_key_plan(keys)


weight_plan = original_layout_plan(original_plan)


def model_config(detection: Detection, options: Optional[dict] = None) -> dict:
    """The diffusers config to build, with the head size from options["head_dim"] when given.

    Order of precedence: the head_dim option, then what the files state (diffusers config.json, original release
    config.json, or our test checkpoints' metadata key), then Wan's real head size, 128.
    """
    config = dict(detection.config)
    inner = config.pop("inner_dim_unsplit", None) or config["attention_head_dim"] * config["num_attention_heads"]
    wanted = (options or {}).get("head_dim") or config["attention_head_dim"]
    if wanted is None:
        raise ValueError(f"this Wan checkpoint is {inner} wide, which is not a multiple of Wan's head size "
                         f"{DEFAULT_HEAD_DIM}: load it with the option head_dim=<size> (or write the size in the "
                         f"file's safetensors metadata under {HEAD_DIM_METADATA_KEY!r})")
    head_dim = int(wanted)
    if head_dim < 6 or head_dim % 2 or inner % head_dim:
        raise ValueError(f"head_dim={head_dim} does not fit a Wan model {inner} wide: it must divide the width and "
                         f"be even and at least 6 (3-axis rotary embeddings)")
    config.update(attention_head_dim=head_dim, num_attention_heads=inner // head_dim)
    config["patch_size"] = tuple(config["patch_size"])
    return config


def model_class(variant: str):
    """diffusers' class of a Detection.variant (WanTransformer3DModel unless a variant names its own)."""
    import diffusers
    name = next((v.model_class for v in REGISTRY if v.model_class and v.name == variant), "WanTransformer3DModel")
    return getattr(diffusers, name)


def attach_extra_modules(model, extras: dict) -> None:
    """The modules of Wan variants that diffusers' classes lack, from their config entries (extra_module_keys)."""
    for variant in REGISTRY:
        if variant.attach is not None and any(extras.get(key) for key in variant.config_keys):
            variant.attach(model, extras)


def load_model(path: str, dtype: str = "default", device: torch.device | str = "cpu",
               detection: Optional[Detection] = None, options: Optional[dict] = None,
               progress: Optional[ProgressFn] = None, header: Optional[Header] = None
               ) -> tuple[torch.nn.Module, Detection, WeightDtypes]:
    """The variant's diffusers class with the checkpoint's weights on `device`, stock attention processors."""
    header, detection = detected_checkpoint(path, header, detection, detect, FAMILY, "Wan")
    config = {**model_config(detection, options), **folder_overrides(header_config(header))}
    dtypes = choose_dtypes(dtype, header, detection.prefix)
    extras = {key: config.pop(key, None) for key in extra_module_keys()}
    model = build_empty_model(model_class(detection.variant), config, dtypes)
    attach_extra_modules(model, extras)
    keys = [key[len(detection.prefix):] for key in header.tensors if key.startswith(detection.prefix)]
    plan = weight_plan(detection, keys)
    ignore = [key for key in keys if key.endswith(DIFFUSERS_IGNORED_SUFFIX)] if plan is None else []
    load_weights(model, header.source, device=device, dtypes=dtypes, prefix=detection.prefix,
                 plan=plan, ignore=ignore, progress=progress)
    return model, detection, dtypes


def worker_from_model(model, detection: Detection, dtypes: WeightDtypes, options: Optional[dict] = None
                      ) -> PlanWorker:
    """The executor around a built model (load(), synthetic models), running the plan of its variants."""
    plan = plan_for(variants_of(model, detection.variant))
    return PlanWorker(model, model_info(model, detection, dtypes), plan, dtypes, options)


load = pool_load(load_model, worker_from_model)


def model_info(model, detection: Detection, dtypes: WeightDtypes) -> ModelInfo:
    config = model.config
    described = config_entries(config, INFO_KEYS)
    described.update(dim=config.num_attention_heads * config.attention_head_dim,
                     num_heads=config.num_attention_heads, head_dim=config.attention_head_dim)
    for variant in variants_of(model, detection.variant):
        if variant.info is not None:
            described.update(variant.info(model))
    return ModelInfo(family=FAMILY, variant=detection.variant, in_channels=config.in_channels,
                     out_channels=config.out_channels, x_ndim=5, config=described,
                     weight_dtype=dtypes.storage_name, compute_dtype=dtypes.compute_name)
