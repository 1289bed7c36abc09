"""The contract between the worker pool and a model family: what a loaded model exposes and what one call gets.

The pool is generic: it only knows LoadRequest -> WorkerModel and WorkerModel.forward(...). Families (Qwen-Image,
Flux, Wan, the test toy) live in their own modules and register in sp_runtime.families (see its docstring).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol

import torch

from .checkpoints.header import Header
from .groups import ParallelGroups


class Cancelled(Exception):
    """The caller cancelled a call; every rank stopped at the same point."""


@dataclass
class Detection:
    """What a family's detect(header) found: family, variant, key layout, key prefix, model config, weight files."""

    family: str
    variant: str = ""
    layout: str = ""       # "original" (ComfyUI / reference keys) or "diffusers"
    prefix: str = ""       # stripped from every key, e.g. "model.diffusion_model."
    config: dict = field(default_factory=dict)
    files: tuple[str, ...] = ()
    quant: str = ""        # the quantized format, e.g. "gguf (Q4_K x 120)"; "" for plain float files

    def to_dict(self) -> dict:
        """JSON-ready form (the host sends it with a load request); the config's tuples stay tuples."""
        return {**self.__dict__, "config": _tagged(self.config), "files": list(self.files)}

    @classmethod
    def from_dict(cls, data: dict) -> "Detection":
        return cls(**{**data, "config": _untagged(data["config"]), "files": tuple(data["files"])})


def _tagged(value):
    """A model config as JSON, which has no tuples: tuples and dicts travel tagged (a config may hold either)."""
    if isinstance(value, (tuple, list)):
        items = [_tagged(item) for item in value]
        return {"tuple": items} if isinstance(value, tuple) else items
    if isinstance(value, dict):
        return {"dict": {key: _tagged(item) for key, item in value.items()}}
    return value


def _untagged(value):
    if isinstance(value, list):
        return [_untagged(item) for item in value]
    if isinstance(value, dict):
        return tuple(map(_untagged, value["tuple"])) if "tuple" in value else \
            {key: _untagged(item) for key, item in value["dict"].items()}
    return value


@dataclass(frozen=True)
class LoadRequest:
    """What to load: a file or folder, a weight dtype name (see dtype_name) and family-specific options.

    header: the checkpoint's header as the host read it (once per load); workers read it themselves when None.
    detection: what the host's detection found in that header (family, prefix, config, quantization): workers and
    LoRAs use it and detect nothing themselves (None: a request made without the host, e.g. by a test).
    stamp: [inode, size, mtime_ns] of each file read, as the host saw them (checkpoint.checkpoint_stamp): a file
    replaced or rewritten on disk makes another model.
    """

    path: str
    dtype: str = "default"
    options: dict = field(default_factory=dict)
    header: Optional[Header] = field(default=None, compare=False, repr=False)
    stamp: list = field(default_factory=list)
    detection: Optional[Detection] = field(default=None, compare=False, repr=False)

    @functools.cached_property
    def key(self) -> str:
        """Cache key of a loaded model inside a worker (made once: the pool asks for it several times per call)."""
        import json
        return json.dumps([self.path, self.dtype, self.options, self.stamp], sort_keys=True)

    def to_message(self) -> dict:
        """JSON-ready form sent to the workers."""
        return {"path": self.path, "dtype": self.dtype, "options": self.options,
                "header": None if self.header is None else self.header.to_dict(), "stamp": self.stamp,
                "detection": None if self.detection is None else self.detection.to_dict()}

    @classmethod
    def from_message(cls, message: dict) -> "LoadRequest":
        header, detection = message.get("header"), message.get("detection")
        return cls(message["path"], message["dtype"], message["options"],
                   None if header is None else Header.from_dict(header), message.get("stamp", []),
                   None if detection is None else Detection.from_dict(detection))


def latent_channels(info: "ModelInfo") -> dict:
    """ComfyUI's unet_config latent channels (ComfyHost's default unet_config)."""
    return {"in_channels": info.in_channels, "out_channels": info.out_channels}


def patch_size_2(info: "ModelInfo") -> dict:
    """ComfyUI's Flux / Qwen-Image latent patch (diffusers' Flux config says 1), read from diffusion_model."""
    return {"patch_size": 2}


class HostHooks:
    """What the host's proxy (nodes/proxy.py) does around one pool call that differs by family: it calls these and
    names no family. The defaults pass the call through; a family subclasses what it needs (LTX-2: packing,
    HunyuanVideo 1.5 SR: sampler inputs) and gives an instance as ComfyHost(hooks=...). Plain Python, no ComfyUI.

    rope_options: what becomes of ScaleROPE's transformer option rope_options: "applied" (the workers get them as
    the input `rope_options`, sp.rope_options), "ignored" (ComfyUI's model ignores them too) or "refused".
    refused_options: transformer option -> (the value at which it is harmless, why another is refused), for the
    switches of this family's ComfyUI network the workers do not serve; the host's allow-list
    (nodes/model_options_policy.py) takes them in.
    """

    rope_options = "refused"
    refused_options: Mapping[str, tuple[Any, str]] = {}

    def __init__(self, rope_options: Optional[str] = None):
        if rope_options is not None:
            self.rope_options = rope_options

    def call_inputs(self, transformer_options: dict, inputs: dict) -> dict:
        """Extra pool inputs taken from the sampler's state, for models whose ComfyUI network reads it there
        (transformer_options itself stays host-only)."""
        return {}

    def pack(self, x, timestep, inputs: dict) -> tuple:
        """ComfyUI's call (x, timestep, inputs) -> the pool's, for models whose call is not the pool's (x a list of
        latents, timestep a tuple)."""
        return x, timestep, inputs

    def unpack(self, out: torch.Tensor, x):
        """The pool's output -> ComfyUI's, shaped like the call's x."""
        return out


@dataclass(frozen=True)
class ComfyHost:
    """What ComfyUI's host side needs of a family (nodes/comfy_model.py, nodes/proxy.py); plain data, no ComfyUI.

    model_classes: variant -> comfy.supported_models class name, as ComfyUI's own detection maps the same files;
        variant "" matches any variant of the family.
    unet_config: ModelInfo -> the unet_config entries ComfyUI's model class reads at run time (concat_cond,
        memory estimates), in ComfyUI's own convention (default: the latent channels).
    attributes: ModelInfo -> plain attributes ComfyUI's model class reads from `diffusion_model`.
    helpers: attribute -> (module, class, args, kwargs) of weightless ComfyUI objects its model class calls on
        `diffusion_model` (e.g. LTX-2's patchifiers); the host builds them (sp_runtime never imports ComfyUI).
    hooks: the family's HostHooks (what the proxy does around each call).
    metadata_variants: variants ComfyUI's detection tells only from the file's metadata (Wan Animate 2): where it
        finds another class of the family (a file whose key layout says the variant), the variant's class is used.
    file_tensors: small tensors of the file, not weights, that ComfyUI's nodes read from `diffusion_model` (SeedVR2's
        stored prompt embeddings): the host reads just these from the file when first asked (read_file_tensor).
    """

    model_classes: Mapping[str, str]
    unet_config: Callable[["ModelInfo"], dict] = latent_channels
    attributes: Callable[["ModelInfo"], dict] = patch_size_2
    helpers: Mapping[str, tuple] = field(default_factory=dict)
    hooks: HostHooks = HostHooks()
    metadata_variants: tuple[str, ...] = ()
    file_tensors: tuple[str, ...] = ()

    def model_class(self, variant: str) -> Optional[str]:
        return self.model_classes.get(variant or "") or self.model_classes.get("")


@dataclass
class ModelInfo:
    """JSON-ready description a worker returns after loading; the host sizes outputs from it."""

    family: str
    variant: str
    in_channels: int
    out_channels: int
    x_ndim: int
    config: dict = field(default_factory=dict)
    weight_dtype: str = "default"
    compute_dtype: str = "float32"
    quant: str = ""          # a quantized file's format summary (sp_runtime.formats), "" for float files
    weight_bytes: int = 0    # bytes of weights held on each rank (quantized layers as stored)
    quant_kernels: dict = field(default_factory=dict)  # layer format -> matmul path taken (formats.choose_kernels)

    def output_shape(self, x_shape: tuple[int, ...]) -> tuple[int, ...]:
        """ComfyUI's diffusion_model returns x's shape with out_channels in dim 1."""
        return (x_shape[0], self.out_channels, *x_shape[2:])

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def config_entries(config, keys) -> dict:
    """The entries of a model config named in `keys` (those it has), JSON-ready (tuples as lists): ModelInfo.config."""
    return {key: list(config[key]) if isinstance(config[key], tuple) else config[key] for key in keys if key in config}


class CallContext(Protocol):
    """What the pool gives a family for one call, inside a worker."""

    device: torch.device
    groups: ParallelGroups

    def to_device(self, name: str, tensor: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Copy an input to the worker's device, reusing the last copy when the input did not change."""

    def check_cancel(self) -> None:
        """Raise Cancelled on every rank at once if the caller asked to cancel (call between blocks)."""


class WorkerModel(Protocol):
    """A model loaded in one worker."""

    info: ModelInfo

    def forward(self, x: torch.Tensor, timestep: torch.Tensor, inputs: dict[str, Any],
                out: torch.Tensor, ctx: CallContext) -> None:
        """Run ComfyUI's diffusion_model(x, timestep, **inputs) and write this rank's share of the result into out.

        x, timestep and tensors in inputs are CPU tensors (shared-memory views; treat as read-only).
        out has info.output_shape(x.shape) and x's dtype; every rank writes its own disjoint part, and the parts
        of all ranks together cover out.
        """

