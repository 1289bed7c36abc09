"""The weight a list of WeightPatches makes of a base weight: ComfyUI's formulas (comfy/lora.py calculate_weight and
comfy/weight_adapter/*: LoRA with LoCon mid, LoHa, LoKr, GLoRA, OFT, BOFT, DoRA's weight decomposition, diff, set),
restated here because the workers never import ComfyUI. Everything runs in float32 (ComfyUI's intermediate dtype)
on the weight's device, in list order; unlike ComfyUI, a patch that does not fit its weight raises instead of being
logged and skipped.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .patch_set import WeightPatch

F32 = torch.float32


def patched_weight(weight: torch.Tensor, patches: Sequence[WeightPatch], key: str) -> torch.Tensor:
    """`weight` (float32, changed in place where ComfyUI changes it in place) with `patches` applied in order."""
    for patch in patches:
        whole = weight
        part = weight.narrow(*patch.offset) if patch.offset is not None else weight
        if patch.strength_model != 1.0:
            part *= patch.strength_model
        try:
            result = KIND_MATH[patch.kind](part, patch)
        except RuntimeError as error:  # shapes that do not multiply: a patch for another model
            raise ValueError(f"{patch.kind} patch on {key} (shape {list(part.shape)}) does not fit: {error}") from None
        weight = whole if patch.offset is not None else result
    return weight


def is_additive(patch: WeightPatch) -> bool:
    """True when the patch adds a delta that does not depend on the weight (so it can stay unmerged)."""
    return (patch.kind in ("lora", "loha", "lokr", "diff") and "dora_scale" not in patch.tensors
            and patch.strength_model == 1.0)


def low_rank(patch: WeightPatch) -> Optional[tuple[torch.Tensor, torch.Tensor, float]]:
    """(down [r, in], up [out, r], factor) of a plain LoRA patch (delta = factor x up @ down), else None."""
    if patch.kind != "lora" or not is_additive(patch) or "mid" in patch.tensors:
        return None
    up, down = patch.tensors["up"].to(F32).flatten(1), patch.tensors["down"].to(F32).flatten(1)
    return down, up, patch.strength * _alpha(patch, down.shape[0])


def _cast(patch: WeightPatch, name: str, weight: torch.Tensor) -> Optional[torch.Tensor]:
    tensor = patch.tensors.get(name)
    return None if tensor is None else tensor.to(device=weight.device, dtype=F32)


def _alpha(patch: WeightPatch, rank: Optional[int]) -> float:
    """ComfyUI's scale: alpha / rank when the file has an alpha (and the kind a rank), else 1."""
    return patch.alpha / rank if patch.alpha is not None and rank else 1.0


def _add(weight: torch.Tensor, patch: WeightPatch, diff: torch.Tensor, alpha: float) -> torch.Tensor:
    """weight + strength x alpha x diff, or DoRA's decomposition when the patch has a dora_scale."""
    diff = diff.reshape(weight.shape)
    if "dora_scale" in patch.tensors:
        return weight_decompose(_cast(patch, "dora_scale", weight), weight, diff, alpha, patch.strength)
    weight += (patch.strength * alpha) * diff
    return weight


def weight_decompose(dora_scale: torch.Tensor, weight: torch.Tensor, diff: torch.Tensor, alpha: float,
                     strength: float) -> torch.Tensor:
    """DoRA: (weight + alpha x diff) rescaled to dora_scale / its norm per output row (or per input column when
    dora_scale runs along the input), blended with the weight by strength."""
    diff *= alpha
    combined = weight + diff
    if dora_scale.shape[0] == combined.shape[0]:
        norm = weight.reshape(weight.shape[0], -1).norm(dim=1, keepdim=True)
        norm = norm.reshape(weight.shape[0], *[1] * (weight.dim() - 1))
    else:
        columns = combined.transpose(0, 1)
        norm = columns.reshape(combined.shape[1], -1).norm(dim=1, keepdim=True)
        norm = norm.reshape(combined.shape[1], *[1] * (combined.dim() - 1)).transpose(0, 1)
    combined *= dora_scale / (norm + torch.finfo(weight.dtype).eps)
    if strength != 1.0:
        combined -= weight
        weight += strength * combined
    else:
        weight[:] = combined
    return weight


def _lora(weight: torch.Tensor, patch: WeightPatch) -> torch.Tensor:
    up, down, mid = (_cast(patch, name, weight) for name in ("up", "down", "mid"))
    alpha = _alpha(patch, down.shape[0])
    if mid is not None:  # LoCon's mid (Tucker) conv kernel folded into down
        shape = [down.shape[1], down.shape[0], mid.shape[2], mid.shape[3]]
        down = torch.mm(down.transpose(0, 1).flatten(1), mid.transpose(0, 1).flatten(1)).reshape(shape)
        down = down.transpose(0, 1)
    return _add(weight, patch, torch.mm(up.flatten(1), down.flatten(1)), alpha)


def _tucker(core: torch.Tensor, right: torch.Tensor, left: torch.Tensor) -> torch.Tensor:
    return torch.einsum("i j k l, j r, i p -> p r k l", core, right, left)


def _loha(weight: torch.Tensor, patch: WeightPatch) -> torch.Tensor:
    w1a, w1b, w2a, w2b, t1, t2 = (_cast(patch, n, weight) for n in ("w1a", "w1b", "w2a", "w2b", "t1", "t2"))
    if t1 is not None:
        first, second = _tucker(t1, w1b, w1a), _tucker(t2, w2b, w2a)
    else:
        first, second = torch.mm(w1a, w1b), torch.mm(w2a, w2b)
    return _add(weight, patch, first * second, _alpha(patch, w1b.shape[0]))


def _lokr(weight: torch.Tensor, patch: WeightPatch) -> torch.Tensor:
    """ComfyUI's newest LoKr (comfy/weight_adapter/lokr.py at 839df9f2): alpha divides by the rank of a decomposed
    factor, or, with both factors full, by w2's rows // w1's rows (0.3.64 - 0.33.0 scaled full factors by 1)."""
    w1, w2, w1a, w1b, w2a, w2b, t2 = (_cast(patch, n, weight) for n in ("w1", "w2", "w1a", "w1b", "w2a", "w2b", "t2"))
    rank = None if w1 is None or w2 is None else w2.shape[0] // w1.shape[0]
    if rank == 0 and patch.alpha is not None:  # ComfyUI divides alpha by 0 here (ZeroDivisionError)
        raise RuntimeError(f"full LoKr factors with w2 rows {w2.shape[0]} < w1 rows {w1.shape[0]}: alpha / "
                           f"(w2 rows // w1 rows) divides by zero")
    if w1 is None:
        rank, w1 = w1b.shape[0], torch.mm(w1a, w1b)
    if w2 is None:
        rank = w2b.shape[0]
        w2 = torch.mm(w2a, w2b) if t2 is None else _tucker(t2, w2b, w2a)
    if w2.dim() == 4:
        w1 = w1[:, :, None, None]
    return _add(weight, patch, torch.kron(w1, w2), _alpha(patch, rank))


def _glora(weight: torch.Tensor, patch: WeightPatch) -> torch.Tensor:
    a1, a2, b1, b2 = (patch.tensors[name] for name in ("a1", "a2", "b1", "b2"))
    old_layout = a1.shape[0] == a2.shape[1] == b1.shape[0] == b2.shape[1]  # (old LyCORIS GLoRA)
    rank = a1.shape[0] if old_layout else None
    if b2.shape[0] == b1.shape[1] == a1.shape[1] == a2.shape[0]:
        if not (old_layout and a2.shape[0] == weight.shape[0] == weight.shape[1]):
            old_layout, rank = False, a2.shape[0]
    a1, a2, b1, b2 = (_cast(patch, name, weight).flatten(1) for name in ("a1", "a2", "b1", "b2"))
    if old_layout:
        diff = torch.mm(b2, b1) + torch.mm(torch.mm(weight.flatten(1), a2), a1)
    elif weight.dim() > 2:
        diff = torch.einsum("o i ..., i j -> o j ...", torch.einsum("o i ..., i j -> o j ...", weight, a1), a2)
        diff = diff.reshape(weight.shape) + torch.mm(b1, b2).reshape(weight.shape)
    else:
        diff = torch.mm(torch.mm(weight, a1), a2) + torch.mm(b1, b2)
    return _add(weight, patch, diff.reshape(weight.shape), _alpha(patch, rank))


def _rotations(blocks: torch.Tensor, constraint: float) -> torch.Tensor:
    """Cayley rotations of the skew-symmetric parts of `blocks`, their norm bounded by `constraint` when > 0."""
    skew = blocks - blocks.transpose(-1, -2)
    if constraint > 0:
        norm = torch.norm(skew) + 1e-8
        if norm > constraint:
            skew = skew * constraint / norm
    eye = torch.eye(blocks.shape[-1], device=blocks.device, dtype=blocks.dtype)
    return (eye + skew) @ (eye - skew).float().inverse()


def _oft(weight: torch.Tensor, patch: WeightPatch) -> torch.Tensor:
    blocks = _cast(patch, "blocks", weight)
    count, size = blocks.shape[0], blocks.shape[1]
    alpha = patch.alpha or 0.0
    rotation = _rotations(blocks, alpha)
    eye = torch.eye(size, device=blocks.device, dtype=blocks.dtype)
    rest = weight.shape[1:]
    diff = torch.einsum("k n m, k n ... -> k m ...", rotation * patch.strength - patch.strength * eye,
                        weight.view(count, size, *rest)).view(-1, *rest)
    if "dora_scale" in patch.tensors:
        return weight_decompose(_cast(patch, "dora_scale", weight), weight, diff, alpha, patch.strength)
    weight += patch.strength * diff
    return weight


def _boft(weight: torch.Tensor, patch: WeightPatch) -> torch.Tensor:
    blocks = _cast(patch, "blocks", weight)
    stages, size = blocks.shape[0], blocks.shape[2]
    rotation = _rotations(blocks, patch.alpha or 0.0)
    eye = torch.eye(size, device=blocks.device, dtype=blocks.dtype)
    rotated, half = weight, size // 2
    for stage in range(stages):
        block = rotation[stage]
        if patch.strength != 1:
            block = block * patch.strength + (1 - patch.strength) * eye
        stride = 2 ** stage * half  # butterfly: pair rows `stride` apart, rotate blocks of `size` rows
        rotated = rotated.unflatten(0, (-1, 2, stride)).transpose(1, 2).flatten(0, 2).unflatten(0, (-1, size))
        rotated = torch.einsum("b i j, b j ... -> b i ...", block, rotated)
        rotated = rotated.flatten(0, 1).unflatten(0, (-1, stride, 2)).transpose(1, 2).flatten(0, 2)
    rescale = _cast(patch, "rescale", weight)
    if rescale is not None:
        rotated = rotated * rescale
    diff = rotated - weight
    if "dora_scale" in patch.tensors:
        return weight_decompose(_cast(patch, "dora_scale", weight), weight, diff, patch.alpha, patch.strength)
    weight += patch.strength * diff
    return weight


def _diff(weight: torch.Tensor, patch: WeightPatch) -> torch.Tensor:
    diff = _cast(patch, "diff", weight)
    if diff.shape != weight.shape:
        raise RuntimeError(f"a difference of shape {list(diff.shape)}")
    if patch.strength != 0.0:
        weight += patch.strength * diff
    return weight


def _set(weight: torch.Tensor, patch: WeightPatch) -> torch.Tensor:
    weight.copy_(_cast(patch, "value", weight))  # ComfyUI's "set" ignores the strength
    return weight


KIND_MATH: dict[str, Callable[[torch.Tensor, WeightPatch], torch.Tensor]] = {
    "lora": _lora, "loha": _loha, "lokr": _lokr, "glora": _glora, "oft": _oft, "boft": _boft, "diff": _diff,
    "set": _set}
