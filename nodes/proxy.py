"""The weightless `diffusion_model` of an SP MODEL: each call runs ComfyUI's DIFFUSION_MODEL wrappers around a call
to the worker pool, polls ComfyUI's Cancel flag while it waits, and turns pool failures into clear node errors.
"""
from __future__ import annotations

import importlib
from typing import Optional

import torch

import comfy.model_management
import comfy.patcher_extension

from sp_runtime.families import comfy_host, families
from sp_runtime.checkpoints.dtypes import DTYPES
from sp_runtime.checkpoints.header import read_file_tensor
from sp_runtime.contract import Cancelled, HostHooks, patch_size_2
from sp_runtime.lora.patch_set import PatchSet
from sp_runtime.sp.rope_options import is_identity

from . import model_options_policy as policy
from .controlnet import controlnet_inputs
from .model_spec import ModelSpec
from .pool_owner import OWNER

HOST_ONLY_KEYS = ("transformer_options", "control")
ROPE_OPTION_KEYS = ("scale_x", "shift_x", "scale_y", "shift_y", "scale_t", "shift_t")


class WeightPath:
    """A module path of the checkpoint seen from the host (`blocks.0.self_attn.q`): attribute and index access go
    down the path; `.weight` is a meta tensor when `<path>.weight` is a weight. Nothing runs through it."""

    def __init__(self, shapes: dict, path: str, dtype):
        self._shapes, self.path, self._dtype = shapes, path, dtype
        self.sp_key = f"{path}.weight"  # the weight a bypass adapter on this module changes

    @classmethod
    def find(cls, shapes: dict, path: str, dtype) -> Optional["WeightPath"]:
        prefix = path + "."
        return cls(shapes, path, dtype) if any(key.startswith(prefix) for key in shapes) else None

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if name == "weight" and self.sp_key in self._shapes:
            return torch.empty(self._shapes[self.sp_key], dtype=self._dtype or torch.float32, device="meta")
        found = WeightPath.find(self._shapes, f"{self.path}.{name}", self._dtype)
        if found is None:
            raise AttributeError(f"the Ulysses SP model has no module {self.path}.{name}")
        return found

    def __getitem__(self, index: int):
        try:
            return self.__getattr__(str(index))
        except AttributeError as error:
            raise IndexError(str(error)) from None


class SPPoolError(RuntimeError):
    """A worker pool failure, worded for the ComfyUI user; the pool restarts on the next run."""


class SPDiffusionModel(torch.nn.Module):
    """Stands where ComfyUI's diffusion network would be. Attributes ComfyUI's model classes read are plain
    attributes (dtype, channels, and what the family's ComfyHost lists), never parameters. It holds the model's
    handle, so a call reads no file on the host (no path resolution, stat or detection). Its state dict shows the
    checkpoint's weights as meta tensors (`weight_shapes`, ComfyUI's names) so ComfyUI's LoRA key matching finds
    them; `weight_patches` (set by SPModelPatcher.pre_run) goes to the workers with every call."""

    def __init__(self, spec: ModelSpec, info, owner=OWNER, weight_shapes: Optional[dict] = None):
        super().__init__()
        self.spec = spec
        self.info = info
        self.owner = owner
        self.weight_shapes = dict(weight_shapes or {})
        self.weight_patches: Optional[PatchSet] = None
        self.handle = None  # the pool's ModelHandle of spec's model, from the first call on (PoolOwner.serving)
        self.option_origins: Optional[policy.OptionOrigins] = None  # set by SPModelPatcher.pre_run
        self._meta: Optional[dict[str, torch.Tensor]] = None
        self.dtype = DTYPES.get(info.compute_dtype, torch.float32)
        self.in_channels = info.in_channels
        self.out_channels = info.out_channels
        host = comfy_host(info.family)
        self.hooks = host.hooks if host is not None else HostHooks()
        for name, value in (host.attributes if host else patch_size_2)(info).items():
            setattr(self, name, value)
        self.file_tensors = host.file_tensors if host else ()
        for name, (module, cls, args, kwargs) in (host.helpers if host else {}).items():
            setattr(self, name, getattr(importlib.import_module(module), cls)(*args, **kwargs))

    def with_spec(self, spec: ModelSpec) -> "SPDiffusionModel":
        return SPDiffusionModel(spec, self.info, self.owner, self.weight_shapes)

    def __getattr__(self, name: str):
        """Besides nn.Module's own: the checkpoint's module paths as WeightPath stand-ins (ComfyUI's bypass LoRA
        looks the modules of its weight keys up this way; SPModelPatcher.set_injections turns them into patches)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in self.__dict__.get("file_tensors", ()):
                return self._file_tensor(name)
            path = WeightPath.find(self.__dict__.get("weight_shapes") or {}, name, self.__dict__.get("dtype"))
            if path is None:
                raise
            return path

    def _file_tensor(self, name: str) -> torch.Tensor:
        """A non-weight tensor ComfyUI's nodes read from the model (ComfyHost.file_tensors), read from the file once
        and kept (a few hundred KB: SeedVR2's stored prompts), in the compute dtype as ComfyUI's model holds it."""
        tensor = read_file_tensor(self.spec.path, name).to(self.dtype)
        self.__dict__[name] = tensor
        return tensor

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self._meta is None:
            self._meta = {name: torch.empty(shape, dtype=self.dtype, device="meta")
                          for name, shape in self.weight_shapes.items()}
        for name, tensor in self._meta.items():
            destination[prefix + name] = tensor

    def forward(self, x, timestep, context=None, transformer_options={}, **kwargs):
        wrappers = comfy.patcher_extension.get_all_wrappers(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL,
                                                            transformer_options)
        executor = comfy.patcher_extension.WrapperExecutor.new_class_executor(self._forward, self, wrappers)
        return executor.execute(x, timestep, context, transformer_options, **kwargs)

    def _forward(self, x, timestep, context, transformer_options, **kwargs):
        self._check_options(transformer_options)
        extra = {key: value for key, value in kwargs.items() if key not in HOST_ONLY_KEYS}
        extra.update(self._rope_input(transformer_options))
        extra.update(_skip_input(transformer_options))
        hooks = self.hooks
        extra.update(hooks.call_inputs(transformer_options, extra))
        try:
            packed, timestep, extra = hooks.pack(x, timestep, extra)
            self.handle = self.owner.serving(self.spec, self.handle, self.weight_patches)
            extra.update(controlnet_inputs(kwargs.get("control"), self.handle.pool))
            out = self.handle(packed, timestep, context=context,
                              should_cancel=comfy.model_management.processing_interrupted, **extra)
            return hooks.unpack(out, x)
        except Cancelled:
            comfy.model_management.throw_exception_if_processing_interrupted()
            raise comfy.model_management.InterruptProcessingException()
        except Exception as error:
            converted = _as_node_error(error)
            if converted is error:
                raise
            raise converted from error

    def _check_options(self, transformer_options: dict) -> None:
        """Per call: what the sampler, hooks and conditionings add to transformer_options must be on the allow-list
        (model_options_policy; the patcher checked its own options before sampling)."""
        origins = self.option_origins or policy.OptionOrigins()
        try:
            policy.check(policy.transformer_option_keys(transformer_options), origins.origin)
        except policy.RefusedOption as error:
            raise SPPoolError(str(error)) from None

    def _rope_input(self, transformer_options: dict) -> dict:
        """ScaleROPE's rope_options as the workers' `rope_options` input (only the scales and shifts that differ
        from identity), as the family's host hooks say (HostHooks.rope_options): applied, ignored or refused."""
        options = transformer_options.get("rope_options") or {}
        values = {key: float(options.get(key, 1.0 if key.startswith("scale") else 0.0)) for key in ROPE_OPTION_KEYS}
        unknown = sorted(set(options) - set(ROPE_OPTION_KEYS))
        if unknown:
            raise SPPoolError(f"rope_options keys {unknown} are not known to ulysses-sp (known: "
                              f"{', '.join(ROPE_OPTION_KEYS)}); remove the node that sets them")
        if is_identity(values):
            return {}
        if self.hooks.rope_options == "ignored":
            return {}
        if self.hooks.rope_options != "applied":
            applied = [entry.name for entry in families()
                       if entry.comfy is not None and entry.comfy.hooks.rope_options == "applied"]
            raise SPPoolError(f"ScaleROPE (transformer option rope_options) is not implemented in the Ulysses SP "
                              f"workers for {self.info.family} models yet (implemented for: "
                              f"{', '.join(applied)}); remove the ScaleROPE node")
        return {"rope_options": values}


def _skip_input(transformer_options: dict) -> dict:
    """SkipLayerGuidanceDiT's block skips of this call (patches_replace["dit"], checked by the policy to be skips
    only) as the workers' `skip_blocks` input ({block kind: indices}); the family's plan maps them to its blocks."""
    skips = policy.block_skips((transformer_options.get("patches_replace") or {}).get("dit"))
    return {"skip_blocks": skips} if skips else {}


def _as_node_error(error: Exception) -> Exception:
    from sp_runtime.pool.errors import WorkerError
    if isinstance(error, (SPPoolError, comfy.model_management.InterruptProcessingException)):
        return error
    if isinstance(error, WorkerError):
        text = str(error)
        if "restarts" not in text:
            text += "\n(the pool restarts on the next run if it has to)"
        return SPPoolError(f"Ulysses SP worker pool failed: {text}")
    if isinstance(error, ValueError):
        return SPPoolError(f"Ulysses SP model call rejected: {error}")
    return error
