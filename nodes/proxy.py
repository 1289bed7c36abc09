"""The weightless `diffusion_model` of an SP MODEL: each call runs ComfyUI's DIFFUSION_MODEL wrappers around a call
to the worker pool, polls ComfyUI's Cancel flag while it waits, and turns pool failures into clear node errors.
"""
from __future__ import annotations

import importlib
from typing import Optional

import torch

import comfy.model_management
import comfy.patcher_extension

from sp_runtime.families import comfy_host
from sp_runtime.families.base import DTYPES, Cancelled, patch_size_2
from sp_runtime.lora.patch_set import PatchSet

from .model_spec import ModelSpec
from .pool_owner import OWNER

HOST_ONLY_KEYS = ("transformer_options", "control")
# Options ComfyUI's LTX-2 network reads to skip streams or blocks (STG guidance); the workers always run everything.
STREAM_SWITCH_DEFAULTS = {"run_vx": True, "run_ax": True, "a2v_cross_attn": True, "v2a_cross_attn": True,
                          "stg_self_attn_blocks": False, "stg_skip_self_attn": False}


class SPPoolError(RuntimeError):
    """A worker pool failure, worded for the ComfyUI user; the pool restarts on the next run."""


class SPDiffusionModel(torch.nn.Module):
    """Stands where ComfyUI's diffusion network would be. Attributes ComfyUI's model classes read are plain
    attributes (dtype, channels, and what the family's ComfyHost lists), never parameters. Its state dict shows the
    checkpoint's weights as meta tensors (`weight_shapes`, ComfyUI's names) so ComfyUI's LoRA key matching finds
    them; `weight_patches` (set by SPModelPatcher.pre_run) goes to the workers with every call."""

    def __init__(self, spec: ModelSpec, info, owner=OWNER, weight_shapes: Optional[dict] = None):
        super().__init__()
        self.spec = spec
        self.info = info
        self.owner = owner
        self.weight_shapes = dict(weight_shapes or {})
        self.weight_patches: Optional[PatchSet] = None
        self._meta: Optional[dict[str, torch.Tensor]] = None
        self.dtype = DTYPES.get(info.compute_dtype, torch.float32)
        self.in_channels = info.in_channels
        self.out_channels = info.out_channels
        host = comfy_host(info.family)
        self.host = host
        for name, value in (host.attributes if host else patch_size_2)(info).items():
            setattr(self, name, value)
        for name, (module, cls, args, kwargs) in (host.helpers if host else {}).items():
            setattr(self, name, getattr(importlib.import_module(module), cls)(*args, **kwargs))

    def with_spec(self, spec: ModelSpec) -> "SPDiffusionModel":
        return SPDiffusionModel(spec, self.info, self.owner, self.weight_shapes)

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
        _reject_host_patches(transformer_options, kwargs.get("control"))
        extra = {key: value for key, value in kwargs.items() if key not in HOST_ONLY_KEYS}
        if self.host is not None and self.host.sampler_inputs is not None:
            extra.update(self.host.sampler_inputs(transformer_options, extra))
        packing = self.host is not None and self.host.pack_call is not None
        try:
            packed, timestep, extra = self.host.pack_call(x, timestep, extra) if packing else (x, timestep, extra)
            out = self.owner.call(self.spec, packed, timestep, context=context, patches=self.weight_patches,
                                  should_cancel=comfy.model_management.processing_interrupted, **extra)
            return self.host.unpack_output(out, x) if packing else out
        except Cancelled:
            comfy.model_management.throw_exception_if_processing_interrupted()
            raise comfy.model_management.InterruptProcessingException()
        except Exception as error:
            converted = _as_node_error(error)
            if converted is error:
                raise
            raise converted from error


def _reject_host_patches(transformer_options: dict, control) -> None:
    """Patches that ComfyUI would run inside its own network cannot reach the workers: say so, never ignore."""
    if control is not None:
        raise SPPoolError("ControlNet / control inputs are not supported on a Ulysses SP model yet: the control "
                          "network would have to run inside the SP workers. Remove the ControlNet apply node.")
    patches = {key: value for key, value in (transformer_options.get("patches") or {}).items() if value}
    replaces = {key: value for key, value in (transformer_options.get("patches_replace") or {}).items() if value}
    switched = {key: transformer_options[key] for key, default in STREAM_SWITCH_DEFAULTS.items()
                if key in transformer_options and bool(transformer_options[key]) != default}
    if switched:
        raise SPPoolError(f"transformer options {switched} (set by a guidance node such as STG or a stream switch) "
                          f"would change what ComfyUI's network runs, and the Ulysses SP workers run every stream "
                          f"and block in full; remove that node for SP models")
    if patches or replaces:
        names = sorted(patches) + sorted(replaces)
        raise SPPoolError(f"model patches {names} (added by a node such as an IP-Adapter, PuLID or attention "
                          f"patch) cannot run inside the Ulysses SP workers and would silently do nothing; remove "
                          f"that node for SP models")


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
