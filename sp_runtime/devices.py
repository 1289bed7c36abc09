"""The one device grammar of ulysses-sp, used by the loader node, the CLI and SPConfig.

A devices text is "auto" (every visible CUDA GPU), GPU indices "0,1,2,3" / "cuda:0,cuda:1", ranges "0-3" (mixable:
"0-1,4"), or CPU workers: "cpu:N" (also "cpu*N", or "cpu" repeated: "cpu,cpu"); one worker per entry. An entry
prefixed by a machine name is a device of a joined machine (docs/MULTI_MACHINE.md): "0-3,node2:0-3" (GPUs 0-3 here
and on node2), "cpu:2,node2:cpu:2"; such a device is written "node2:cuda:0" / "node2:cpu".
The text is bounded before anything is expanded: at most MAX_DEVICES_TEXT characters, GPU indices up to
MAX_GPU_INDEX (the highest torch can name), at most MAX_CPU_WORKERS CPU workers; each GPU at most once.
"""
from __future__ import annotations

import re
from typing import Callable, Optional

_CPU = re.compile(r"^cpu(?:[:*](\d+))?$")
_RANGE = re.compile(r"^(\d+)-(\d+)$")
_GPU = re.compile(r"^(?:cuda:)?(\d+)$")
_MACHINE = re.compile(r"^([a-z][a-z0-9_.-]{0,62}):(.+)$")  # "node2:cuda:0": a joined machine's device
LOCAL_NAMES = ("cpu", "cuda")  # never machine names
MAX_CPU_WORKERS = 64
# torch keeps a device index in an int8 (c10::DeviceIndex): cuda:127 is the highest index any process can name
# (torch.device("cuda:128") wraps to cuda:-128), so no GPU list is longer than 128 entries
MAX_GPU_INDEX = 127
MAX_DEVICES_TEXT = 1024  # characters: 0..127 written out one by one is ~400
DEVICE_HELP = ("use 'auto' (every visible GPU), GPU indices such as '0,1,2,3' or '0-3', or 'cpu:2' for two "
               "CPU workers")


def visible_cuda_count() -> int:
    """GPUs this process can see (CUDA_VISIBLE_DEVICES applies); 0 without CUDA."""
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def split_machine(device: str) -> tuple[str, str]:
    """("node2", "cuda:0") for a joined machine's device "node2:cuda:0"; ("", device) for a device here."""
    match = _MACHINE.match(str(device).strip().lower())
    if match and match.group(1) not in LOCAL_NAMES:
        return match.group(1), match.group(2)
    return "", str(device)


def machine_of(device: str) -> str:
    """The joined machine a device is on ("" for this machine)."""
    return split_machine(device)[0]


def local_device(device: str) -> str:
    """The device as its own machine names it: "node2:cuda:0" -> "cuda:0"."""
    return split_machine(device)[1]


def parse_device(device: str) -> str:
    """Normalise one device entry to 'cpu' or 'cuda:N' (with 'machine:' in front for a joined machine's device);
    raise ValueError naming the bad entry."""
    machine, text = split_machine(str(device).strip().lower())
    if machine:
        return f"{machine}:{parse_device(text)}"
    text = text.strip().lower()
    gpu = _GPU.match(text)
    if text == "cpu":
        return text
    if gpu:
        return f"cuda:{_gpu_index(text, gpu.group(1))}"
    raise ValueError(
        f"device {device!r} is not understood: use 'cpu' or 'cuda:N' (N = a GPU index such as 0), "
        f"one entry per worker")


def parse_devices(text: str, cuda_count: Optional[int] = None, count_gpus: Callable[[], int] = visible_cuda_count,
                  auto_cpu_workers: Optional[int] = None) -> list[str]:
    """Device list for one pool, e.g. 'cpu:2' -> ['cpu', 'cpu'], '0,1' -> ['cuda:0', 'cuda:1'].

    cuda_count: visible GPUs (None: ask count_gpus, only when GPUs are asked for). auto_cpu_workers: what 'auto'
    means on a machine without GPUs (None: an error).
    """
    spec = str(text).strip().lower().replace(" ", "")
    if not spec:
        raise ValueError(f"devices is empty: {DEVICE_HELP}")
    if len(spec) > MAX_DEVICES_TEXT:
        raise ValueError(f"devices text has {len(spec)} characters, more than the limit of {MAX_DEVICES_TEXT}: "
                         f"{DEVICE_HELP}")
    groups: dict[str, list[str]] = {}  # machine ("" here) -> its entries, in the order machines first appear
    for part in spec.split(","):
        machine, text = split_machine(part)
        groups.setdefault(machine, []).append(text)
    if len(groups) > 1 or "" not in groups:
        return _machine_devices(spec, groups, cuda_count, count_gpus, auto_cpu_workers)
    return _local_devices(spec, groups[""], cuda_count, count_gpus, auto_cpu_workers)


def _machine_devices(spec: str, groups: dict[str, list[str]], cuda_count, count_gpus, auto_cpu_workers
                     ) -> list[str]:
    """Devices over several machines: each machine's entries parsed like a local list (a joined machine's GPUs
    are checked there, when it joins), this machine's first, then the others in order of appearance."""
    devices, kinds = [], set()
    for machine, parts in sorted(groups.items(), key=lambda item: item[0] != ""):
        if machine and "auto" in parts:
            raise ValueError(f"devices={spec!r}: '{machine}:auto' is not possible: name the joined machine's "
                             f"devices, e.g. '{machine}:0-3' or '{machine}:cpu:2'")
        found = _local_devices(spec, parts, cuda_count if not machine else MAX_GPU_INDEX + 1, count_gpus,
                               auto_cpu_workers)
        kinds.update(device.split(":")[0] for device in found)
        devices.extend(f"{machine}:{device}" if machine else device for device in found)
    if len(kinds) > 1:
        raise ValueError(f"devices={spec!r} mix CPU and CUDA: CPU and GPU workers cannot be mixed in one pool; "
                         f"{DEVICE_HELP}")
    return devices


def _local_devices(spec: str, parts: list[str], cuda_count, count_gpus, auto_cpu_workers) -> list[str]:
    cpu_parts = [part for part in parts if _CPU.match(part)]
    if cpu_parts and len(cpu_parts) < len(parts):
        raise ValueError(f"devices={spec!r} mix CPU and CUDA: CPU and GPU workers cannot be mixed in one pool; "
                         f"{DEVICE_HELP}")
    if cpu_parts:
        workers = [device for part in cpu_parts for device in _cpu_devices(spec, part)]
        if len(workers) > MAX_CPU_WORKERS:
            raise ValueError(f"devices={spec!r} asks for {len(workers)} CPU workers, more than the limit of "
                             f"{MAX_CPU_WORKERS}; e.g. 'cpu:2'")
        return workers
    count = count_gpus() if cuda_count is None else cuda_count
    if parts == ["auto"]:
        return _auto(count, auto_cpu_workers)
    indices = _gpu_indices(spec, parts)
    _check_indices(spec, indices, count)
    return [f"cuda:{index}" for index in indices]


def _auto(count: int, cpu_workers: Optional[int]) -> list[str]:
    if count:
        return [f"cuda:{index}" for index in range(count)]
    if cpu_workers:
        return ["cpu"] * cpu_workers
    raise ValueError("devices='auto' found no CUDA GPU in this process (torch.cuda.device_count() is 0; "
                     "check the driver and CUDA_VISIBLE_DEVICES); to run on the CPU use 'cpu:2'")


def _cpu_devices(spec: str, part: str) -> list[str]:
    workers = int(_CPU.match(part).group(1) or 1)
    if not 1 <= workers <= MAX_CPU_WORKERS:
        raise ValueError(f"devices={spec!r}: the number of CPU workers must be 1..{MAX_CPU_WORKERS}, e.g. 'cpu:2'")
    return ["cpu"] * workers


def _gpu_indices(spec: str, parts: list[str]) -> list[int]:
    """The GPU indices of the entries, each checked against MAX_GPU_INDEX before a range is expanded."""
    indices: list[int] = []
    for part in parts:
        span = _RANGE.match(part)
        single = _GPU.match(part)
        if span:
            first, last = _gpu_index(spec, span.group(1)), _gpu_index(spec, span.group(2))
            if last < first:
                raise ValueError(f"devices={spec!r}: the range {part!r} runs backwards; write it as "
                                 f"'{last}-{first}'")
            indices.extend(range(first, last + 1))
        elif single:
            indices.append(_gpu_index(spec, single.group(1)))
        else:
            raise ValueError(f"devices={spec!r}: {part!r} is not understood (not a GPU index, a range or "
                             f"cpu:N); {DEVICE_HELP}")
    return indices


def _gpu_index(spec: str, digits: str) -> int:
    significant = digits.lstrip("0") or "0"
    index = int(significant) if len(significant) <= 3 else MAX_GPU_INDEX + 1  # never int() of 1000 digits
    if index > MAX_GPU_INDEX:
        raise ValueError(f"devices={spec!r}: GPU index {digits[:12]}{'...' if len(digits) > 12 else ''} is above "
                         f"{MAX_GPU_INDEX}, the highest CUDA device index torch can name; use the indices of the "
                         f"visible GPUs (0..N-1)")
    return index


def _check_indices(spec: str, indices: list[int], count: int) -> None:
    seen: set[int] = set()
    repeated = sorted({index for index in indices if index in seen or seen.add(index)})
    if repeated:
        raise ValueError(f"devices={spec!r} lists GPU {repeated} more than once: each GPU runs one worker")
    if count == 0:
        raise ValueError(f"devices={spec!r} asks for CUDA GPUs but this process sees none (check the driver and "
                         f"CUDA_VISIBLE_DEVICES); to run on the CPU use 'cpu:{len(indices)}'")
    missing = [index for index in indices if index >= count]
    if missing:
        raise ValueError(f"devices={spec!r} asks for GPU {missing}, but only {count} GPU(s) are visible "
                         f"(0..{count - 1}); use 'auto' or indices below {count}")
