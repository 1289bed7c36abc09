"""ControlNets inside a call: each ControlNet (a loaded PlanWorker whose head returns its residuals per main-model
block) runs on this rank's own leading tokens of the model's control stream, and its residuals, scaled by their
strengths and summed in chain order as ComfyUI's control_merge does, are added to those tokens after each block."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..attention import SeqShards


def control_residuals(call, plan, family: str) -> Optional["Residuals"]:
    """The call's input controlnets ([{"model": ControlNet worker, "hint": tensor, "strength": float}, ...], the
    chain's first ControlNet first) run on this rank's tokens; None without any."""
    entries = call.inputs.get("controlnets")
    if not entries:
        return None
    if plan.control is None:
        raise ValueError(f"ControlNets are not supported for {family} models under sequence parallelism yet; "
                         f"remove the ControlNet apply node")
    outputs = []
    for entry in entries:
        net = entry["model"]
        if net.info.family not in plan.control.families:
            raise ValueError(f"a {net.info.family} ControlNet cannot steer a {family} model (it takes "
                             f"{', '.join(plan.control.families)})")
        samples = net.residuals(call, entry["hint"], plan.control.stream)
        outputs.append(_scaled(samples, float(entry["strength"])))
    return Residuals(outputs, plan.control)


def leading_shards(shards: SeqShards, total: int) -> SeqShards:
    """Each rank's part of the first `total` tokens of a split sequence (its tokens [lo, hi) clipped to them)."""
    sizes = []
    for rank in range(shards.degree):
        lo, hi = shards.range(rank)
        sizes.append(max(0, min(hi, total) - min(lo, total)))
    if sum(sizes) != total:
        raise ValueError(f"a ControlNet has {total} tokens but the model's stream has only {shards.total}")
    return SeqShards(total, tuple(sizes))


def _scaled(samples: list[torch.Tensor], strength: float) -> list[torch.Tensor]:
    """Every residual times the strength, a tensor repeated over several blocks scaled once (ComfyUI shares it)."""
    done: dict[int, torch.Tensor] = {}
    return [done.setdefault(id(sample), sample * strength) for sample in samples]


class Residuals:
    """The ControlNets' scaled residuals per main-model block; the chain's sum is formed block by block."""

    def __init__(self, outputs: list[list[torch.Tensor]], control):
        self.outputs, self.control = outputs, control

    def at(self, index: int) -> Optional[torch.Tensor]:
        total = None
        for samples in self.outputs:
            if index < len(samples):
                total = samples[index] if total is None else total + samples[index]
        return total

    def adder(self, call, blocks: str) -> Optional[Callable[[int], None]]:
        """index -> adds residual `index` to the stream's leading tokens on this rank (None: not this stage)."""
        if blocks != self.control.stage:
            return None
        name = self.control.stream

        def add(index: int) -> None:
            residual = self.at(index)
            if residual is not None and residual.shape[1]:
                state = getattr(call, name)
                state[:, :residual.shape[1]] += residual.to(state.dtype)
        return add
