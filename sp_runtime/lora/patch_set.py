"""Weight patches as ComfyUI's ModelPatcher holds them (stock LoRA nodes, `add_patches`), in a neutral form the
host builds and the workers apply: per target weight (named as the checkpoint / ComfyUI names it), a list of
patches, each a kind, its tensors and scalars. No ComfyUI here; JSON plus named tensors for the trip over shared
memory, and a digest that names a set (the workers cache sets by it).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

# kind -> (tensors it must have, tensors it may have), as comfy/weight_adapter/* and comfy/lora.py hold them
KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "lora": (("up", "down"), ("mid", "dora_scale")),
    "loha": (("w1a", "w1b", "w2a", "w2b"), ("t1", "t2", "dora_scale")),
    "lokr": ((), ("w1", "w2", "w1a", "w1b", "w2a", "w2b", "t2", "dora_scale")),
    "glora": (("a1", "a2", "b1", "b2"), ("dora_scale",)),
    "oft": (("blocks",), ("rescale", "dora_scale")),
    "boft": (("blocks",), ("rescale", "dora_scale")),
    "diff": (("diff",), ()),
    "set": (("value",), ()),
}


@dataclass(frozen=True)
class WeightPatch:
    """One entry of ComfyUI's patch list for a weight: (strength, adapter, strength_model, offset) with the
    adapter's tensors by name. offset: (dim, start, length) of the weight the patch acts on (a fused qkv's q)."""

    kind: str
    tensors: dict[str, torch.Tensor]
    strength: float = 1.0
    alpha: Optional[float] = None
    strength_model: float = 1.0
    offset: Optional[tuple[int, int, int]] = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"weight patch kind {self.kind!r} is not supported on Ulysses SP models (supported: "
                             f"{', '.join(KINDS)})")
        required, optional = KINDS[self.kind]
        missing = [name for name in required if name not in self.tensors]
        unknown = sorted(set(self.tensors) - set(required) - set(optional))
        if missing or unknown:
            raise ValueError(f"{self.kind} patch: missing tensors {missing}, unknown tensors {unknown}")
        for number in (self.strength, self.strength_model, self.alpha):
            if number is not None and not math.isfinite(number):
                raise ValueError(f"{self.kind} patch: strengths and alpha must be finite, got {number!r}")

    def scalars(self) -> dict:
        return {"kind": self.kind, "strength": self.strength, "alpha": self.alpha,
                "strength_model": self.strength_model, "offset": list(self.offset) if self.offset else None}


@dataclass(frozen=True)
class TargetPatches:
    """The patches of one weight, in order; `shape`: the weight's shape in the checkpoint's key space."""

    shape: tuple[int, ...]
    patches: tuple[WeightPatch, ...]


@dataclass
class PatchSet:
    """Every patched weight of one model: name (checkpoint / ComfyUI key, no prefix) -> TargetPatches, and labels
    (what a person reads in status(): one per `add_patches` call, with its strength)."""

    targets: dict[str, TargetPatches]
    labels: tuple[tuple[str, float], ...] = ()
    _digest: Optional[str] = field(default=None, repr=False, compare=False)

    def to_message(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """(JSON-ready description, tensors by the names it uses): what travels to the workers."""
        tensors: dict[str, torch.Tensor] = {}
        targets = {}
        for key, target in self.targets.items():
            entries = []
            for index, patch in enumerate(target.patches):
                names = {}
                for name, tensor in patch.tensors.items():
                    names[name] = f"{key}/{index}/{name}"
                    tensors[names[name]] = tensor
                entries.append({**patch.scalars(), "tensors": names})
            targets[key] = {"shape": list(target.shape), "patches": entries}
        return {"targets": targets, "labels": [list(label) for label in self.labels]}, tensors

    @classmethod
    def from_message(cls, message: dict, tensor_for: Callable[[str], torch.Tensor]) -> "PatchSet":
        targets = {}
        for key, target in message["targets"].items():
            patches = tuple(_patch_from(entry, tensor_for) for entry in target["patches"])
            targets[key] = TargetPatches(tuple(target["shape"]), patches)
        return cls(targets, tuple((str(name), float(strength)) for name, strength in message.get("labels", ())))

    @property
    def digest(self) -> str:
        """Names the set's content (scalars, shapes and tensor bytes): equal sets have equal digests."""
        if self._digest is None:
            description, tensors = self.to_message()
            hasher = hashlib.blake2b(json.dumps(description, sort_keys=True).encode(), digest_size=16)
            for name in sorted(tensors):
                tensor = tensors[name].detach().cpu().contiguous()
                hasher.update(f"{name}:{tensor.dtype}:{list(tensor.shape)}".encode())
                hasher.update(tensor.reshape(-1).view(torch.uint8).numpy())  # the bytes, not a copy
            self._digest = hasher.hexdigest()
        return self._digest

    def summary(self) -> dict:
        """JSON-ready: the digest, the labels with strengths, how many weights it patches."""
        return {"digest": self.digest, "loras": [list(label) for label in self.labels], "weights": len(self.targets)}


def _patch_from(entry: dict, tensor_for: Callable[[str], torch.Tensor]) -> WeightPatch:
    """One patch of a description (its tensors looked up by name); the inverse of WeightPatch.scalars + tensors."""
    return WeightPatch(entry["kind"], {name: tensor_for(ref) for name, ref in entry["tensors"].items()},
                       float(entry["strength"]), None if entry["alpha"] is None else float(entry["alpha"]),
                       float(entry["strength_model"]), tuple(entry["offset"]) if entry["offset"] else None)
