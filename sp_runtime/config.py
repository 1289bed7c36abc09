"""SPConfig: the validated parallel layout (devices and Ulysses / Ring / CFG / tensor-parallel degrees) of one
worker pool.

Rank order puts tensor parallelism innermost (neighbouring ranks, usually the fastest links: its all-reduces move
activations twice per block), then Ulysses, Ring, CFG outermost:
rank = ((cfg_index * ring_degree + ring_index) * ulysses_degree + ulysses_index) * tensor_parallel_degree + tp_index.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

from .devices import local_device, machine_of, parse_device, parse_devices

MAX_CFG_DEGREE = 2  # a CFG batch holds at most two halves: cond and uncond


def valid_layouts(world_size: int) -> list[tuple[int, int, int]]:
    """Every (ulysses, ring, cfg) whose product is world_size, Ulysses-heavy first."""
    layouts = []
    for cfg in range(1, MAX_CFG_DEGREE + 1):
        if world_size % cfg:
            continue
        sp = world_size // cfg
        for ring in range(1, sp + 1):
            if sp % ring == 0:
                layouts.append((sp // ring, ring, cfg))
    return sorted(layouts, key=lambda layout: (layout[2], layout[1]))


def format_layout(ulysses: int, ring: int, cfg: int) -> str:
    parts = [f"ulysses_degree={ulysses}"]
    if ring > 1:
        parts.append(f"ring_degree={ring}")
    if cfg > 1:
        parts.append(f"cfg_degree={cfg}")
    return ", ".join(parts)


def _suggestion(world_size: int) -> str:
    layouts = valid_layouts(world_size)
    return "; ".join(f"({format_layout(*layout)})" for layout in layouts) or "none"


@dataclass(frozen=True)
class SPConfig:
    """Devices (one worker each) and how they are split into Ulysses x Ring x CFG x tensor-parallel groups.

    ulysses_degree=0 means "whatever the devices leave": len(devices) // (ring_degree * cfg_degree * tp degree).
    """

    devices: Sequence[str]
    ulysses_degree: int = 0
    ring_degree: int = 1
    cfg_degree: int = 1
    tensor_parallel_degree: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.devices, str):
            raise ValueError(f"devices must be a list such as ['cuda:0', 'cuda:1'], got the string {self.devices!r}")
        devices = tuple(parse_device(d) for d in self.devices)
        if not devices:
            raise ValueError("devices is empty: give at least one device, e.g. ['cpu'] or ['cuda:0', 'cuda:1']")
        object.__setattr__(self, "devices", devices)
        self._check_devices(devices)
        self._check_degrees(len(devices))

    @staticmethod
    def _check_devices(devices: tuple[str, ...]) -> None:
        kinds = {local_device(d).split(":")[0] for d in devices}
        if len(kinds) > 1:
            raise ValueError(f"devices {list(devices)} mix CPU and CUDA: one pool runs on one kind of device")
        cuda = [d for d in devices if d.startswith("cuda")]
        duplicates = sorted({d for d in cuda if cuda.count(d) > 1})
        if duplicates:
            raise ValueError(
                f"devices {list(devices)} list {duplicates} more than once: NCCL needs one worker per GPU; "
                f"use each GPU once, or 'cpu' entries for CPU workers")

    def _check_degrees(self, world_size: int) -> None:
        for name in ("ulysses_degree", "ring_degree", "cfg_degree", "tensor_parallel_degree"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            if value < (0 if name == "ulysses_degree" else 1):
                raise ValueError(f"{name}={value} must be >= {0 if name == 'ulysses_degree' else 1}")
        if self.cfg_degree > MAX_CFG_DEGREE:
            raise ValueError(
                f"cfg_degree={self.cfg_degree} is not possible: a CFG batch has {MAX_CFG_DEGREE} halves "
                f"(cond, uncond); valid layouts for {world_size} devices: {_suggestion(world_size)}")
        tp = self.tensor_parallel_degree
        outer = self.ring_degree * self.cfg_degree * tp
        ulysses = self.ulysses_degree
        others = f"ring_degree={self.ring_degree} x cfg_degree={self.cfg_degree}" + (
            f" x tensor_parallel_degree={tp}" if tp > 1 else "")
        if ulysses == 0:
            if world_size % outer:
                raise ValueError(
                    f"{others} = {outer} does not divide "
                    f"{world_size} devices; valid layouts for {world_size} devices: {_suggestion(world_size)}")
            object.__setattr__(self, "ulysses_degree", world_size // outer)
        elif ulysses * outer != world_size:
            raise ValueError(
                f"ulysses_degree={ulysses} x {others} = "
                f"{ulysses * outer}, but there are {world_size} devices {list(self.devices)}: the product of the "
                f"degrees must equal the number of devices; valid layouts for {world_size} devices: "
                f"{_suggestion(world_size)}")

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def sp_degree(self) -> int:
        """Sequence shards of one CFG half: ulysses_degree x ring_degree."""
        return self.ulysses_degree * self.ring_degree

    @property
    def cfg_group_size(self) -> int:
        """Ranks that share one CFG half: sp_degree x tensor_parallel_degree."""
        return self.sp_degree * self.tensor_parallel_degree

    @property
    def backend(self) -> str:
        return "nccl" if local_device(self.devices[0]).startswith("cuda") else "gloo"

    @property
    def layout_name(self) -> str:
        """Short name used by the CLI and benchmarks: u2, u2r2, u2cfg2, 1 ..."""
        name = f"u{self.ulysses_degree}" if self.ulysses_degree > 1 else ""
        name += f"r{self.ring_degree}" if self.ring_degree > 1 else ""
        name += f"cfg{self.cfg_degree}" if self.cfg_degree > 1 else ""
        name += f"tp{self.tensor_parallel_degree}" if self.tensor_parallel_degree > 1 else ""
        return name or "1"

    @property
    def machines(self) -> list[str]:
        """The machines the ranks run on ("" is this one), each once, in rank order."""
        return list(dict.fromkeys(machine_of(device) for device in self.devices))

    def machine_of(self, rank: int) -> str:
        """The machine rank `rank` runs on ("" for the host's own)."""
        return machine_of(self.devices[rank])

    def ulysses_groups_across_machines(self) -> list[list[int]]:
        """Ulysses groups (ranks) whose all-to-alls would cross machines (slow links); [] when each group shares a
        machine."""
        groups: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            cfg, ring, _ = self.coords(rank)
            groups.setdefault((cfg, ring, self.tp_index(rank)), []).append(rank)
        return [ranks for ranks in groups.values() if len({self.machine_of(rank) for rank in ranks}) > 1]

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(cfg_index, ring_index, ulysses_index) of a global rank (its TP index: tp_index)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}")
        position = rank // self.tensor_parallel_degree  # ranks of one TP group share every other coordinate
        ulysses_index = position % self.ulysses_degree
        ring_index = (position // self.ulysses_degree) % self.ring_degree
        cfg_index = position // self.sp_degree
        return cfg_index, ring_index, ulysses_index

    def tp_index(self, rank: int) -> int:
        """The rank's position in its tensor-parallel group (innermost axis)."""
        return rank % self.tensor_parallel_degree

    def to_dict(self) -> dict:
        return {"devices": list(self.devices), "ulysses_degree": self.ulysses_degree,
                "ring_degree": self.ring_degree, "cfg_degree": self.cfg_degree,
                "tensor_parallel_degree": self.tensor_parallel_degree}

    @classmethod
    def from_layout(cls, devices: Sequence[str], layout: str) -> "SPConfig":
        """Parse a CLI layout name ('1', 'u2', 'u2r2', 'r2', 'u2cfg2', 'tp2', 'u2tp2') for the given devices."""
        match = re.fullmatch(r"(?:u(\d+))?(?:r(\d+))?(?:cfg(\d+))?(?:tp(\d+))?|1", layout.strip().lower())
        if not match:
            raise ValueError(f"layout {layout!r} is not understood: use names like 1, u2, u4, r2, u2r2, u2cfg2, "
                             f"tp2, u2tp2")
        ulysses, ring, cfg, tp = (int(g) if g else 1 for g in match.groups())
        return cls(devices=list(devices)[: ulysses * ring * cfg * tp], ulysses_degree=ulysses,
                   ring_degree=ring, cfg_degree=cfg, tensor_parallel_degree=tp)


def build_config(devices: Sequence[str], ulysses_degree: int = 0, ring_degree: int = 1,
                 cfg_parallel: bool = False, tensor_parallel_degree: int = 1) -> SPConfig:
    """SPConfig for the loader node's inputs; ulysses_degree 0 = as many as devices / (ring x cfg x tp)."""
    cfg_degree = 2 if cfg_parallel else 1
    if cfg_parallel and len(devices) % 2:
        raise ValueError(f"cfg_parallel needs an even number of devices (cond and uncond each get half), but there "
                         f"are {len(devices)} {list(devices)}; turn cfg_parallel off or use {len(devices) + 1} devices")
    return SPConfig(devices=list(devices), ulysses_degree=int(ulysses_degree), ring_degree=int(ring_degree),
                    cfg_degree=cfg_degree, tensor_parallel_degree=int(tensor_parallel_degree))


def config_from_inputs(devices: str, ulysses_degree: int = 0, ring_degree: int = 1, cfg_parallel: bool = False,
                       cuda_count: Optional[int] = None, tensor_parallel_degree: int = 1) -> SPConfig:
    """The loader node's inputs (devices text in the grammar of sp_runtime.devices) parsed in one go; ValueError
    with the fix in the message."""
    return build_config(parse_devices(devices, cuda_count), ulysses_degree, ring_degree, cfg_parallel,
                        tensor_parallel_degree)
