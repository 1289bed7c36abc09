"""ComfyUI's weight patches (what `ModelPatcher.add_patches` holds: stock LoRA nodes, LyCORIS files, `diff` / `set`
patches) translated into sp_runtime's neutral PatchSet, which the workers apply with the same math. Patches that
cannot be expressed (model merges, weight functions, padding) are refused by name instead of silently dropped.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional

import torch

from sp_runtime.lora.patch_math import patched_weight
from sp_runtime.lora.patch_set import PatchSet, TargetPatches, WeightPatch

PREFIX = "diffusion_model."
CACHED_SETS = 8  # translations kept by patches_uuid (clones of a patched MODEL share theirs)
# ComfyUI adapter name -> the names of the entries of its `weights` tuple ("alpha" is a scalar; None: unused)
ADAPTER_FIELDS = {
    "lora": ("up", "down", "alpha", "mid", "dora_scale", "reshape"),
    "loha": ("w1a", "w1b", "alpha", "w2a", "w2b", "t1", "t2", "dora_scale"),
    "lokr": ("w1", "w2", "alpha", "w1a", "w1b", "w2a", "w2b", "t2", "dora_scale"),
    "glora": ("a1", "a2", "b1", "b2", "alpha", "dora_scale"),
    "oft": ("blocks", "rescale", "alpha", "dora_scale"),
    "boft": ("blocks", "rescale", "alpha", "dora_scale"),
}
_cache: "OrderedDict[Any, PatchSet]" = OrderedDict()


class UnsupportedPatch(ValueError):
    """A weight patch kind the Ulysses SP workers cannot apply."""


def cached_patch_set(cache_key, patches: dict, shapes: dict[str, tuple[int, ...]], labels=()) -> Optional[PatchSet]:
    """translate(patches), None when there are none; cached under `cache_key` (a patcher's patches_uuid and what
    else decides the patches), so a set's digest is computed once."""
    if not patches:
        return None
    cache_key = (cache_key, tuple(labels))
    if cache_key not in _cache:
        _cache[cache_key] = translate(patches, shapes, labels)
        while len(_cache) > CACHED_SETS:
            _cache.popitem(last=False)
    _cache.move_to_end(cache_key)
    return _cache[cache_key]


def translate(patches: dict, shapes: dict[str, tuple[int, ...]], labels=()) -> PatchSet:
    """ModelPatcher.patches ({"diffusion_model.<key>": [(strength, adapter, strength_model, offset, function)]})
    -> PatchSet over the checkpoint keys (prefix dropped)."""
    targets = {}
    for key, entries in patches.items():
        if not key.startswith(PREFIX) or key[len(PREFIX):] not in shapes:
            raise UnsupportedPatch(f"a weight patch for {key!r}, which is not a weight of the Ulysses SP model")
        name = key[len(PREFIX):]
        entries = tuple(_entry(name, entry, shapes[name]) for entry in entries)
        targets[name] = TargetPatches(tuple(shapes[name]), entries)
    return PatchSet(targets, tuple(labels))


def _entry(key: str, entry: tuple, shape: tuple) -> WeightPatch:
    strength, value, strength_model, offset, function = entry
    if function is not None:
        raise UnsupportedPatch(f"the weight patch on {key} carries a weight function ({function!r}), which cannot "
                               f"run inside the Ulysses SP workers")
    scalars = {"strength": float(strength), "strength_model": float(strength_model),
               "offset": tuple(int(number) for number in offset) if offset is not None else None}
    name = getattr(value, "name", None)
    if name is not None and hasattr(value, "weights"):
        row_offset = getattr(value, "row_offset", None)
        if row_offset is not None:
            return _rows_of_fused(key, name, value.weights, int(row_offset), tuple(shape), scalars)
        return _adapter(key, name, value.weights, scalars)
    if isinstance(value, list):
        raise UnsupportedPatch(f"the weight patch on {key} is a model merge (weights of another model), which the "
                               f"Ulysses SP workers cannot apply: merge the checkpoints into one file instead")
    kind, payload = ("diff", value) if len(value) == 1 else value
    if kind in ("diff", "set") and len(payload) > 1 and isinstance(payload[1], dict) and payload[1].get("pad_weight"):
        raise UnsupportedPatch(f"the {kind} patch on {key} pads the weight to another shape, which the Ulysses SP "
                               f"workers cannot do")
    if kind == "diff":
        return WeightPatch("diff", {"diff": payload[0]}, **scalars)
    if kind == "set":
        return WeightPatch("set", {"value": payload[0]}, **scalars)
    raise UnsupportedPatch(f"weight patch kind {kind!r} on {key} is not supported on Ulysses SP models (supported: "
                           f"LoRA, LoHa, LoKr, GLoRA, OFT, BOFT, DoRA, diff, set)")


def _adapter(key: str, name: str, weights: tuple, scalars: dict) -> WeightPatch:
    fields = ADAPTER_FIELDS.get(name)
    if fields is None:
        raise UnsupportedPatch(f"weight adapter {name!r} on {key} is not supported on Ulysses SP models (supported: "
                               f"{', '.join(ADAPTER_FIELDS)}, diff, set)")
    values = dict(zip(fields, weights))
    if values.get("reshape") is not None:
        raise UnsupportedPatch(f"the LoRA on {key} reshapes the weight (a Flux control LoRA, 'reshape_weight'), "
                               f"which the Ulysses SP workers cannot do")
    alpha = values.pop("alpha", None)
    tensors = {field: tensor for field, tensor in values.items() if field != "reshape" and tensor is not None}
    return WeightPatch(name, tensors, alpha=None if alpha is None else float(alpha), **scalars)


def _rows_of_fused(key: str, name: str, weights: tuple, row_offset: int, shape: tuple, scalars: dict) -> WeightPatch:
    """An adapter trained on a fused projection (newer ComfyUI's LoKr `row_offset` / `key`: a fused-qkv LoKr on a
    model with split q / k / v) applied to its rows row_offset.. of this weight: its difference is built here once
    and the workers add those rows as a `diff` patch (same math as ComfyUI: strength x alpha-scaled product)."""
    whole = _adapter(key, name, weights, {"strength": 1.0, "strength_model": 1.0, "offset": None})
    if "dora_scale" in whole.tensors:
        raise UnsupportedPatch(f"the {name} patch on {key} has a row offset and a DoRA scale, which the Ulysses SP "
                               f"workers cannot apply")
    rows = _fused_rows(whole)
    if rows is None or row_offset < 0 or row_offset + shape[0] > rows:
        raise UnsupportedPatch(f"the {name} patch on {key} covers rows {row_offset}..{row_offset + shape[0]} of a "
                               f"fused weight with {rows} rows")
    fused = patched_weight(torch.zeros((rows, *shape[1:]), dtype=torch.float32), [whole], key)
    return WeightPatch("diff", {"diff": fused[row_offset:row_offset + shape[0]].contiguous()}, **scalars)


def _fused_rows(patch: WeightPatch) -> Optional[int]:
    tensors = patch.tensors
    first = tensors["w1"].shape[0] if "w1" in tensors else tensors["w1a"].shape[0] if "w1a" in tensors else None
    second = tensors["w2"].shape[0] if "w2" in tensors else tensors["w2a"].shape[0] if "w2a" in tensors else None
    if patch.kind != "lokr" or first is None or second is None:
        return None
    return first * second
