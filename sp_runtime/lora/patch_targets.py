"""Where a PatchSet's weights are in a loaded diffusers model: each patched checkpoint / ComfyUI key resolved to the
model parameters it became (a fused Flux qkv -> to_q, to_k, to_v), and the checkpoint-space weight put together from
those parameters and split back into them, so patches whose result depends on the whole weight (OFT, DoRA, GLoRA,
offsets into a fused weight) see exactly the weight ComfyUI's model holds.
"""
from __future__ import annotations

import torch

from .keys import KeyResolver, Target
from .patch_set import PatchSet


def resolve_patch_targets(patches: PatchSet, resolver: KeyResolver, parameters: dict[str, torch.Tensor]
                          ) -> dict[str, list[Target]]:
    """checkpoint key -> the Targets that make it; a clear error (and nothing changed) for keys this model lacks or
    shapes that do not fit."""
    groups, unknown = {}, []
    for key, target in patches.targets.items():
        module, _, kind = key.rpartition(".")
        targets = resolver.resolve(module, kind) if module else None
        if not targets:
            unknown.append(key)
            continue
        for found in targets:
            mapped = torch.empty(target.shape, device="meta")
            mapped = found.transform(mapped) if found.transform else mapped
            if mapped.numel() != parameters[found.parameter].numel():
                raise ValueError(f"a weight patch for {key} of shape {list(target.shape)} gives "
                                 f"{list(mapped.shape)} for {found.parameter} of shape "
                                 f"{list(parameters[found.parameter].shape)}: a LoRA for another size of model")
        groups[key] = targets
    if unknown:
        raise ValueError(f"{len(unknown)} patched weights are not in this model (e.g. {sorted(unknown)[:4]}): the "
                         f"LoRA was matched against another model's keys")
    return groups


def row_sources(shape: tuple[int, ...], targets: list[Target], device: torch.device) -> list[torch.Tensor]:
    """For each target, the checkpoint-weight rows its parameter holds, in its order (plan transforms select and
    reorder rows: applied to the row numbers they tell where each row comes from)."""
    numbers = torch.arange(shape[0], dtype=torch.float64, device=device).reshape(-1, 1)
    sources = []
    for target in targets:
        mapped = target.transform(numbers) if target.transform else numbers
        if mapped.dim() != 2 or mapped.shape[1] != 1 or not torch.equal(mapped, mapped.round()):
            raise ValueError(f"{target.parameter} is not a row selection of its checkpoint weight: weight patches "
                             f"that need the whole weight cannot be applied to it")
        sources.append(mapped.reshape(-1).long())
    return sources


def assemble(shape: tuple[int, ...], targets: list[Target], values: dict[str, torch.Tensor],
             sources: list[torch.Tensor]) -> torch.Tensor:
    """The checkpoint-space weight (float32) from its parameters' values."""
    first = next(iter(values.values()))
    weight = torch.empty(shape, dtype=torch.float32, device=first.device)
    covered = torch.zeros(shape[0], dtype=torch.bool, device=first.device)
    for target, rows in zip(targets, sources):
        weight[rows] = values[target.parameter].reshape(len(rows), *shape[1:]).to(torch.float32)
        covered[rows] = True
    if not bool(covered.all()):
        raise ValueError(f"the model's parameters {[t.parameter for t in targets]} hold only some rows of a patched "
                         f"weight of shape {list(shape)}")
    return weight


def split(weight: torch.Tensor, targets: list[Target], sources: list[torch.Tensor],
          parameters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each parameter's part of a checkpoint-space weight, in the parameter's shape."""
    return {target.parameter: weight[rows].reshape(parameters[target.parameter].shape)
            for target, rows in zip(targets, sources)}
