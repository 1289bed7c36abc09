"""Attention kernels behind one call: torch's SDPA (the default), flash-attn 2 / 3 and SageAttention when they are
importable and selected (load option `attention`). None of them is a requirement.

A selected backend that is not installed is an error at load time. A call it cannot serve (CPU tensors, fp32, a
mask, a head size it lacks) falls back to SDPA; each fallback is counted and logged once per reason. Ring
attention gets the log-sum-exp from flash-attn where it is selected and applies (backend_with_lse).
"""
from __future__ import annotations

import functools
import importlib
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .options import current

LOG = logging.getLogger(__name__)
FALLBACKS: Counter = Counter()  # (backend, reason) -> calls served by SDPA instead


@dataclass(frozen=True)
class Kernel:
    """An optional attention library: where it lives, what it serves, and how to call it on [B, H, S, D]."""

    name: str
    module: str
    install: str
    exact: bool                     # False for quantized kernels (SageAttention): not bit-comparable to SDPA
    run: Callable                   # (module, q, k, v, scale) -> out [B, H, S, D]
    run_with_lse: Optional[Callable] = None  # (module, q, k, v, scale) -> (out, lse [B, H, S] float32)
    needs_cuda: bool = True
    max_head_dim: int = 256

    def load(self):
        return importlib.import_module(self.module)

    def cannot_serve(self, query: torch.Tensor, mask) -> Optional[str]:
        """Why this kernel cannot take the call, or None."""
        if mask is not None:
            return "a mask"
        if self.needs_cuda and query.device.type != "cuda":
            return f"{query.device.type} tensors"
        if query.dtype not in (torch.float16, torch.bfloat16):
            return f"{str(query.dtype).removeprefix('torch.')} (needs fp16 / bf16)"
        if query.shape[-1] > self.max_head_dim or query.shape[-1] % 8:
            return f"head size {query.shape[-1]}"
        return None


def _flash(module, q, k, v, scale):
    out = module.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale)
    return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)


def _flash_lse(module, q, k, v, scale):
    result = module.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                                    return_attn_probs=True)
    return result[0].transpose(1, 2), result[1].float()  # flash-attn's LSE is [B, H, S]


def _sage(module, q, k, v, scale):
    return module.sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=scale)


KERNELS = {kernel.name: kernel for kernel in [
    Kernel("flash3", "flash_attn_interface", "flash-attn 3 (build hopper/ from github.com/Dao-AILab/flash-attention)",
           True, _flash, _flash_lse),
    Kernel("flash2", "flash_attn", "pip install flash-attn --no-build-isolation", True, _flash, _flash_lse),
    Kernel("sage", "sageattention", "pip install sageattention", False, _sage),
]}
ALIASES = {"flash": ("flash3", "flash2"), "auto": ("flash3", "flash2")}


def resolve(backend: str) -> Optional[Kernel]:
    """The kernel a backend name means here (None: SDPA); raises ValueError for a selected one not installed.

    "flash" takes flash-attn 3 if installed, else 2; "auto" the same, else SDPA (never the approximate Sage).
    """
    if backend == "sdpa":
        return None
    names = ALIASES.get(backend, (backend,))
    for name in names:
        if _importable(KERNELS[name]):
            return KERNELS[name]
    if backend == "auto":
        return None
    wanted = " or ".join(f"{KERNELS[n].module} ({KERNELS[n].install})" for n in names)
    raise ValueError(f"attention backend {backend!r} needs {wanted}, which is not importable in the workers' "
                     f"Python; install it or use attention='sdpa'")


@functools.lru_cache(maxsize=None)
def _importable(kernel: Kernel) -> bool:
    try:
        kernel.load()
    except Exception:  # noqa: BLE001 - a broken install (wrong CUDA / torch ABI) counts as absent
        return False
    return True


def _note_fallback(kernel: Kernel, reason: str) -> None:
    key = (kernel.name, reason)
    if key not in FALLBACKS:
        LOG.warning("attention backend %s cannot serve %s: using SDPA for such calls", kernel.name, reason)
    FALLBACKS[key] += 1


def _usable(query, mask) -> Optional[Kernel]:
    kernel = resolve(current().backend)
    if kernel is None:
        return None
    reason = kernel.cannot_serve(query, mask)
    if reason is not None:
        _note_fallback(kernel, reason)
        return None
    return kernel


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Optional[torch.Tensor] = None,
           scale: Optional[float] = None) -> torch.Tensor:
    """softmax(q k^T * scale) v over [B, H, S, D] tensors with the current backend; mask as SDPA takes it."""
    kernel = _usable(query, mask)
    if kernel is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    return kernel.run(kernel.load(), query, key, value, scale)


def backend_with_lse(query, key, value, bias, scale) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(out, lse) from the current backend when it gives the LSE and can serve the call, else None."""
    kernel = _usable(query, bias)
    if kernel is None or kernel.run_with_lse is None:
        return None
    return kernel.run_with_lse(kernel.load(), query, key, value, scale)
