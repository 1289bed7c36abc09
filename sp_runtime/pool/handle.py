"""ModelHandle: a model loaded in every worker of a pool, called like ComfyUI's diffusion_model(x, t, ...).

Handles survive pool restarts and unloads: a call through a handle whose model is not resident loads it again, with
the LoRAs set through this handle (`pool.set_loras(handle, ...)`).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from ..contract import LoadRequest, ModelInfo
from ..lora.patch_set import PatchSet
from ..lora.spec import LoraList


class ModelHandle:
    def __init__(self, pool, request: LoadRequest, info: ModelInfo, loras: LoraList = ()):
        self._pool = pool
        self.request = request
        self.info = info
        self.loras: LoraList = loras  # ((absolute path, strength), ...) applied before each call
        self.patches: Optional[PatchSet] = None  # ComfyUI weight patches applied after them

    @property
    def pool(self):
        """The WorkerPool this model lives in."""
        return self._pool

    @property
    def key(self) -> str:
        return self.request.key

    @property
    def path(self) -> str:
        return self.request.path

    @property
    def dtype(self) -> str:
        return self.request.dtype

    @property
    def loaded(self) -> bool:
        """Resident in the workers now (False after unload or a pool restart, until the next call)."""
        return self._pool.is_loaded(self)

    def __call__(self, x: torch.Tensor, timestep: Any, context: Optional[torch.Tensor] = None,
                 should_cancel: Optional[Callable[[], bool]] = None, **extra: Any) -> torch.Tensor:
        """One forward with ComfyUI's diffusion_model arguments; returns a CPU tensor of info.output_shape (the
        pool's output segment itself, not a copy: later calls write elsewhere while the caller holds it)."""
        timestep = validate_call(self.info, x, timestep, {"context": context, **extra})
        return self._pool.run(self, x, timestep, {"context": context, **extra}, should_cancel)

    def set_loras(self, loras: Sequence, progress=None, patches: Optional[PatchSet] = None) -> dict:
        """See WorkerPool.set_loras."""
        return self._pool.set_loras(self, loras, progress, patches)

    def unload(self) -> None:
        self._pool.unload(self)

    def __copy__(self) -> "ModelHandle":
        copy = ModelHandle(self._pool, self.request, self.info, self.loras)
        copy.patches = self.patches
        return copy

    def __deepcopy__(self, memo: dict) -> "ModelHandle":
        # Copies share the pool: ComfyUI deep-copies models (and their diffusion_model proxy) freely.
        return self.__copy__()

    def __repr__(self) -> str:
        loras = f", loras={[list(lora) for lora in self.loras]}" if self.loras else ""
        return (f"ModelHandle({self.info.family}{'/' + self.info.variant if self.info.variant else ''}, "
                f"path={self.path!r}, dtype={self.dtype!r}{loras})")


def validate_call(info: ModelInfo, x: Any, timestep: Any, kwargs: dict) -> torch.Tensor:
    """Reject on the host what the workers would reject; returns timestep as a [B] (or [B, ...]) tensor."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor of latents, got {type(x).__name__}")
    name = info.family + (f" ({info.variant})" if info.variant else "")
    if not x.is_floating_point():
        raise ValueError(f"x has dtype {x.dtype}: the {name} model takes floating-point latents "
                         f"(float32, bfloat16 or float16)")
    if x.dim() != info.x_ndim:
        raise ValueError(f"x has shape {list(x.shape)} ({x.dim()}-D) but the {name} model takes {info.x_ndim}-D "
                         f"latents [B, {info.in_channels}, {', '.join('THW'[-(info.x_ndim - 2):])}]")
    if x.shape[1] != info.in_channels:
        raise ValueError(f"x has {x.shape[1]} channels (shape {list(x.shape)}) but the {name} model takes "
                         f"{info.in_channels}: is this latent from another model's VAE?")
    if x.numel() == 0:
        raise ValueError(f"x has an empty dimension: shape {list(x.shape)}")
    batch = x.shape[0]
    timestep = _timestep_tensor(timestep, batch)
    unbatched = set(info.config.get("unbatched_inputs", ()))
    for key, value in kwargs.items():
        if key == "controlnets":
            _check_controlnets(value, batch)
        elif key not in unbatched:
            _check_batch(key, value, batch)
    refs = kwargs.get("ref_latents")
    for index, ref in enumerate(refs if isinstance(refs, (list, tuple)) else () if refs is None else (refs,)):
        _check_reference(f"ref_latents[{index}]", ref, x, info, name)
    return timestep


def _check_reference(label: str, ref: Any, x: torch.Tensor, info: ModelInfo, name: str) -> None:
    """A reference latent is laid out like x (a 4-D one next to a 5-D x too; one frame next to Qwen-Image-Layered's
    layer frames); a bad one would fail on only the ranks whose tokens it reaches, so it is refused here, before any
    worker sees the call."""
    if not isinstance(ref, torch.Tensor) or not ref.is_floating_point():
        raise ValueError(f"{label} must be a floating-point latent tensor, got "
                         f"{ref.dtype if isinstance(ref, torch.Tensor) else type(ref).__name__}")
    frames_ok = ref.dim() == 4 or (ref.dim() == 5 and x.dim() == 5 and ref.shape[2] in (1, x.shape[2]))
    if not frames_ok or ref.shape[1] != info.in_channels or ref.numel() == 0:
        raise ValueError(f"{label} has shape {list(ref.shape)} but the {name} model takes reference latents "
                         f"[B, {info.in_channels}, H, W]" + (f" or [B, {info.in_channels}, 1 or {x.shape[2]}, H, W]"
                                                            if x.dim() == 5 else "")
                         + ": encode the reference image with this model's VAE")


def _timestep_tensor(timestep: Any, batch: int) -> torch.Tensor:
    if isinstance(timestep, (int, float)) and not isinstance(timestep, bool):
        return torch.full((batch,), float(timestep))
    if not isinstance(timestep, torch.Tensor):
        raise ValueError(f"timestep must be a number or a tensor of shape [{batch}], got {type(timestep).__name__}")
    if timestep.dim() == 0:
        return timestep.reshape(1).expand(batch)
    if timestep.shape[0] != batch:
        raise ValueError(f"timestep has shape {list(timestep.shape)} but x has batch {batch}: give one timestep per "
                         f"batch item")
    return timestep


def _check_controlnets(entries: Any, batch: int) -> None:
    """Each ControlNet's hint serves the whole batch (batch 1, as ComfyUI leaves a single hint) or one per item."""
    for index, entry in enumerate(entries or ()):
        hint = entry.get("hint") if isinstance(entry, dict) else None
        if not isinstance(hint, torch.Tensor) or not hint.is_floating_point() or hint.dim() not in (4, 5) or \
                hint.shape[0] not in (1, batch):
            raise ValueError(f"controlnets[{index}] needs a hint: a floating-point latent [1 or {batch}, C, (1,) H, "
                             f"W], got {list(hint.shape) if isinstance(hint, torch.Tensor) else type(hint).__name__}")


def _check_batch(path: str, value: Any, batch: int) -> None:
    if isinstance(value, torch.Tensor):
        if value.dim() >= 1 and value.shape[0] != batch:
            raise ValueError(f"{path} has shape {list(value.shape)} but x has batch {batch}: batched inputs must "
                             f"have the same batch size as x (cond and uncond are concatenated in both)")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_batch(f"{path}[{index}]", item, batch)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_batch(f"{path}.{key}", item, batch)
