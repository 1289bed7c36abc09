"""The Family object: everything the pool, the host and the LoRA code need of one model family, in one value.

A family package declares `FAMILY = Family(...)` in its __init__ (docs/ADDING_A_FAMILY.md); the registry
(sp_runtime.families) maps names to such packages and derives every other table from their Family objects.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class Family:
    """name: its key in the registry and ModelInfo.family.
    description: named in "supported: ..." messages ("" for internal families: toy, synthetic).
    detect(header) -> Detection | None: from the header alone (no weights read, no diffusers import: it runs in the
        ComfyUI process); None when the file is another family; ValueError naming the file for a variant it cannot run.
    load(request, detection, device, groups, progress) -> WorkerModel: worker side, diffusers imported there.
    comfy: ComfyUI's model classes and what its host side reads (contract.ComfyHost); None when ComfyUI cannot use it.
    weight_plan(detection, keys) / original_plan(keys, config): checkpoint and LoRA key plans (None: no LoRAs).
    load_model(path, dtype, device, ...) -> (model, detection, dtypes): the diffusers model on one device (CLI,
        the lab's references).
    gguf_architectures: `general.architecture` values of its GGUF files, as ComfyUI-GGUF writes them.
    signatures: key suffixes only its files hold: a file that has one and is not detected is named as this family's
        (incomplete, or a variant this version cannot run) instead of being summarised as unknown.
    """

    name: str
    description: str
    detect: Callable[[Any], Any]
    load: Callable[..., Any]
    comfy: Optional[Any] = None
    weight_plan: Optional[Callable] = None
    original_plan: Optional[Callable] = None
    load_model: Optional[Callable] = None
    gguf_architectures: tuple[str, ...] = ()
    signatures: tuple[str, ...] = ()

    @classmethod
    def of(cls, module: ModuleType) -> "Family":
        """The family a registered module declares: its FAMILY object, or (a family written as module-level
        names: FAMILY = "name", DESCRIPTION, detect, load, optional COMFY, weight_plan, original_plan, load_model,
        GGUF_ARCHITECTURES, SIGNATURES) one built from those names."""
        declared = getattr(module, "FAMILY", None)
        if isinstance(declared, Family):
            return declared
        if not isinstance(declared, str):
            raise ValueError(f"{module.__name__} is registered as a model family but declares no FAMILY")
        return cls(name=declared, description=module.DESCRIPTION, detect=module.detect, load=module.load,
                   comfy=getattr(module, "COMFY", None), weight_plan=getattr(module, "weight_plan", None),
                   original_plan=getattr(module, "original_plan", None),
                   load_model=getattr(module, "load_model", None),
                   gguf_architectures=tuple(getattr(module, "GGUF_ARCHITECTURES", ())),
                   signatures=tuple(getattr(module, "SIGNATURES", ())))


@dataclass(frozen=True)
class PlanModel:
    """A family whose model is one diffusers class loaded from a checkpoint and run by the executor, as data:
    `load_model` / `load` / `worker` are then the family's load_model, Family.load and worker_from_model.

    class_name: the diffusers class; kind: the family as "<path> is not a <kind> checkpoint" names it.
    plan: the executor's Plan. x_ndim: the rank of ComfyUI's x. config_keys: the config entries ModelInfo reports.
    prepare(detection, options) -> Detection: what load options make of the file's detection (config, variant).
    channels(model) -> (in_channels, out_channels) as ComfyUI's latents count them (default: the config's).
    ignore: endings of checkpoint keys that carry no weights.
    build(model_class, config, dtypes) -> the empty model (meta weights) where the class built from the detection's
        config is not all of it (modules diffusers' class lacks, ComfyUI's constants); default build_empty_model.
    describe(model, detection) -> ModelInfo.config entries beyond config_keys (what the host side reads).
    """

    family: str
    kind: str
    class_name: str
    detect: Callable
    weight_plan: Callable
    plan: Any
    x_ndim: int
    config_keys: tuple[str, ...]
    prepare: Optional[Callable] = None
    channels: Optional[Callable] = None
    ignore: tuple[str, ...] = ()
    build: Optional[Callable] = None
    describe: Optional[Callable] = None

    def load_model(self, path: str, dtype: str = "default", device="cpu", detection=None,
                   options: Optional[dict] = None, progress=None, header=None):
        """The diffusers model with the checkpoint's weights on `device` (stock attention processors):
        (model, detection, dtypes)."""
        import diffusers
        from ..checkpoints.loading import (build_empty_model, choose_dtypes, detected_checkpoint, load_weights,
                                           strip_prefix)
        header, detection = detected_checkpoint(path, header, detection, self.detect, self.family, self.kind)
        if self.prepare is not None:
            detection = self.prepare(detection, options or {})
        keys = strip_prefix(header.tensors, detection.prefix)
        dtypes = choose_dtypes(dtype, header, detection.prefix)
        model = (self.build or build_empty_model)(getattr(diffusers, self.class_name), detection.config, dtypes)
        load_weights(model, header.source, device=device, dtypes=dtypes, prefix=detection.prefix,
                     plan=self.weight_plan(detection, keys), ignore=[key for key in keys if key.endswith(self.ignore)],
                     progress=progress)
        return model, detection, dtypes

    def worker(self, model, detection, dtypes, options: Optional[dict] = None):
        """The executor running `plan` around a built model (load, synthetic models)."""
        from ..contract import ModelInfo, config_entries
        from ..sp import PlanWorker
        config = model.config
        in_channels, out_channels = (self.channels(model) if self.channels is not None
                                     else (config.in_channels, config.out_channels))
        info = ModelInfo(family=self.family, variant=detection.variant, in_channels=in_channels,
                         out_channels=out_channels, x_ndim=self.x_ndim,
                         config={**config_entries(config, self.config_keys),
                                 **(self.describe(model, detection) if self.describe is not None else {})},
                         weight_dtype=dtypes.storage_name, compute_dtype=dtypes.compute_name)
        return PlanWorker(model, info, self.plan, dtypes, options)

    @property
    def load(self) -> Callable:
        """The pool's entry point (Family.load)."""
        return pool_load(self.load_model, self.worker)


def pool_load(load_model: Callable, worker_from_model: Callable) -> Callable:
    """The pool's entry point (Family.load) of a family whose worker wraps its single-device model: load_model on this
    worker's device, then worker_from_model(model, detection, dtypes, options)."""
    def load(request, detection, device, groups, progress):
        model, detection, dtypes = load_model(request.path, request.dtype, device, detection, request.options,
                                              progress, request.header)
        return worker_from_model(model, detection, dtypes, request.options)
    return load

def by_variant(models: dict, detect: Callable, family: str, kind: str) -> tuple[Callable, Callable]:
    """(load_model, load) of a family whose variants are PlanModels of their own: the file's detection picks one."""
    def load_model(path: str, dtype: str = "default", device="cpu", detection=None, options=None, progress=None,
                   header=None):
        from ..checkpoints.loading import detected_checkpoint
        header, detection = detected_checkpoint(path, header, detection, detect, family, kind)
        return models[detection.variant].load_model(path, dtype, device, detection, options, progress, header)

    def load(request, detection, device, groups, progress):
        return models[detection.variant].load(request, detection, device, groups, progress)
    return load_model, load


def with_rope_axes_option(detection, options: dict):
    """The load option axes_dims_rope (models of unusual head sizes) in the detection's config (PlanModel.prepare)."""
    if "axes_dims_rope" not in options:
        return detection
    return replace(detection, config={**detection.config, "axes_dims_rope": tuple(options["axes_dims_rope"])})


def layout_detection(header, family: str, found, variant_of: Callable[[dict], str] = lambda config: ""):
    """The Detection of checkpoints.loading.two_layouts' answer (layout, prefix, config), None for None; its variant
    is variant_of(config)."""
    from ..contract import Detection
    if found is None:
        return None
    layout, prefix, config = found
    return Detection(family=family, variant=variant_of(config), layout=layout, prefix=prefix, config=config,
                     files=header.source.files)
