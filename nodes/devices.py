"""The loader node's `devices` text and degree inputs turned into an SPConfig (no ComfyUI import: unit-testable).

Accepted device texts: "auto" (every visible CUDA GPU), "0,1,2,3" / "cuda:0,cuda:1" / "0-3" (GPU indices),
"cpu:N" (N CPU workers, gloo) and "cpu" (one CPU worker).
"""
from __future__ import annotations

import re
from typing import Callable, Optional

from sp_runtime.config import SPConfig

_CPU = re.compile(r"^cpu(?::(\d+))?$")
_RANGE = re.compile(r"^(\d+)-(\d+)$")
_GPU = re.compile(r"^(?:cuda:)?(\d+)$")
MAX_CPU_WORKERS = 64
DEVICE_HELP = ("use 'auto' (every visible GPU), GPU indices such as '0,1,2,3' or '0-3', or 'cpu:2' for two "
               "CPU workers")


def visible_cuda_count() -> int:
    """GPUs this process can see (CUDA_VISIBLE_DEVICES applies); 0 without CUDA."""
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def parse_devices(text: str, cuda_count: Optional[int] = None,
                  count_gpus: Callable[[], int] = visible_cuda_count) -> list[str]:
    """Device list for one pool, e.g. 'cpu:2' -> ['cpu', 'cpu'], '0,1' -> ['cuda:0', 'cuda:1']."""
    spec = str(text).strip().lower().replace(" ", "")
    if not spec:
        raise ValueError(f"devices is empty: {DEVICE_HELP}")
    cpu = _CPU.match(spec)
    if cpu:
        return _cpu_devices(spec, int(cpu.group(1) or 1))
    count = count_gpus() if cuda_count is None else cuda_count
    if spec == "auto":
        if count == 0:
            raise ValueError("devices='auto' found no CUDA GPU in this process (torch.cuda.device_count() is 0; "
                             "check the driver and CUDA_VISIBLE_DEVICES); to run on the CPU use 'cpu:2'")
        return [f"cuda:{index}" for index in range(count)]
    indices = _gpu_indices(spec)
    _check_indices(spec, indices, count)
    return [f"cuda:{index}" for index in indices]


def _cpu_devices(spec: str, workers: int) -> list[str]:
    if not 1 <= workers <= MAX_CPU_WORKERS:
        raise ValueError(f"devices={spec!r}: the number of CPU workers must be 1..{MAX_CPU_WORKERS}, e.g. 'cpu:2'")
    return ["cpu"] * workers


def _gpu_indices(spec: str) -> list[int]:
    indices: list[int] = []
    for part in spec.split(","):
        span = _RANGE.match(part)
        single = _GPU.match(part)
        if span:
            first, last = int(span.group(1)), int(span.group(2))
            if last < first:
                raise ValueError(f"devices={spec!r}: the range {part!r} runs backwards; write it as "
                                 f"'{last}-{first}'")
            indices.extend(range(first, last + 1))
        elif single:
            indices.append(int(single.group(1)))
        else:
            raise ValueError(f"devices={spec!r}: {part!r} is not a GPU index; {DEVICE_HELP} (CPU and GPU workers "
                             f"cannot be mixed in one pool)")
    return indices


def _check_indices(spec: str, indices: list[int], count: int) -> None:
    repeated = sorted({index for index in indices if indices.count(index) > 1})
    if repeated:
        raise ValueError(f"devices={spec!r} lists GPU {repeated} more than once: each GPU runs one worker")
    if count == 0:
        raise ValueError(f"devices={spec!r} asks for CUDA GPUs but this process sees none (check the driver and "
                         f"CUDA_VISIBLE_DEVICES); to run on the CPU use 'cpu:{len(indices)}'")
    missing = [index for index in indices if index >= count]
    if missing:
        raise ValueError(f"devices={spec!r} asks for GPU {missing}, but only {count} GPU(s) are visible "
                         f"(0..{count - 1}); use 'auto' or indices below {count}")


def build_config(devices: list[str], ulysses_degree: int = 0, ring_degree: int = 1,
                 cfg_parallel: bool = False) -> SPConfig:
    """SPConfig for the loader's inputs; ulysses_degree 0 = as many as devices / (ring x cfg)."""
    cfg_degree = 2 if cfg_parallel else 1
    if cfg_parallel and len(devices) % 2:
        raise ValueError(f"cfg_parallel needs an even number of devices (cond and uncond each get half), but there "
                         f"are {len(devices)} {devices}; turn cfg_parallel off or use {len(devices) + 1} devices")
    return SPConfig(devices=list(devices), ulysses_degree=int(ulysses_degree), ring_degree=int(ring_degree),
                    cfg_degree=cfg_degree)


def config_from_inputs(devices: str, ulysses_degree: int = 0, ring_degree: int = 1, cfg_parallel: bool = False,
                       cuda_count: Optional[int] = None) -> SPConfig:
    """Parse the loader node's inputs in one go (raises ValueError with the fix in the message)."""
    return build_config(parse_devices(devices, cuda_count), ulysses_degree, ring_degree, cfg_parallel)
