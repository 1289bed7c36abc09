"""Reference weights for ComfyUI's weight patch kinds, written as plain matrix formulas (explicit block-diagonal and
permutation matrices for OFT / BOFT), independently of sp_runtime.lora.patch_math, and random patches to feed both."""
from __future__ import annotations

import torch

from sp_runtime.lora.patch_set import WeightPatch


def cayley(blocks: torch.Tensor, constraint: float) -> torch.Tensor:
    skew = blocks - blocks.transpose(-1, -2)
    norm = skew.norm() + 1e-8
    if constraint > 0 and norm > constraint:
        skew = skew * constraint / norm
    eye = torch.eye(blocks.shape[-1])
    return (eye + skew) @ torch.linalg.inv(eye - skew)


def reference_delta_free(weight: torch.Tensor, patch: WeightPatch) -> torch.Tensor:
    """The patched weight for one patch on the whole weight (no offset), float32."""
    t = {name: tensor.float() for name, tensor in patch.tensors.items()}
    s = patch.strength
    w = weight.float() * patch.strength_model
    if patch.kind == "diff":
        return w + s * t["diff"]
    if patch.kind == "set":
        return t["value"].clone()
    if patch.kind == "oft":
        rotations = cayley(t["blocks"], patch.alpha or 0.0)
        eye = torch.eye(rotations.shape[-1])
        change = torch.block_diag(*[(s * r - s * eye).T for r in rotations])
        diff = (change @ w.flatten(1)).reshape(w.shape)
        return w + s * diff
    if patch.kind == "boft":
        return _boft(w, t, patch)
    diff, rank = _additive(w, t, patch.kind)
    alpha = patch.alpha / rank if patch.alpha is not None and rank else 1.0
    if "dora_scale" in t:
        combined = w + alpha * diff
        norm = w.flatten(1).norm(dim=1, keepdim=True).reshape(-1, *[1] * (w.dim() - 1))
        scaled = combined * (t["dora_scale"] / (norm + torch.finfo(torch.float32).eps))
        return w + s * (scaled - w)
    return w + s * alpha * diff


def _additive(w: torch.Tensor, t: dict, kind: str) -> tuple[torch.Tensor, int]:
    """(the kind's difference before strength x alpha, the rank alpha divides by)"""
    if kind == "lora":
        return (t["up"].flatten(1) @ t["down"].flatten(1)).reshape(w.shape), t["down"].shape[0]
    if kind == "loha":
        return ((t["w1a"] @ t["w1b"]) * (t["w2a"] @ t["w2b"])).reshape(w.shape), t["w1b"].shape[0]
    if kind == "lokr":
        right = t["w2"] if "w2" in t else t["w2a"] @ t["w2b"]
        left = t["w1"] if "w1" in t else t["w1a"] @ t["w1b"]
        rank = (t["w2b"].shape[0] if "w2b" in t else t["w1b"].shape[0] if "w1b" in t
                else t["w2"].shape[0] // t["w1"].shape[0])  # ComfyUI's newest: full factors scale by w2 rows // w1 rows
        return torch.kron(left, right).reshape(w.shape), rank
    if kind == "glora":  # the current LyCORIS layout: W a1 a2 + b1 b2
        return w @ t["a1"] @ t["a2"] + t["b1"] @ t["b2"], t["a2"].shape[0]
    raise ValueError(kind)


def _boft(w: torch.Tensor, t: dict, patch: WeightPatch) -> torch.Tensor:
    """Butterfly OFT as a product of explicit stage matrices P^T blockdiag(R_i) P."""
    rotations = cayley(t["blocks"], patch.alpha or 0.0)
    rows, size = w.shape[0], rotations.shape[-1]
    eye = torch.eye(size)
    product = torch.eye(rows)
    for stage in range(rotations.shape[0]):
        stride = 2 ** stage * (size // 2)
        order = torch.arange(rows).reshape(-1, 2, stride).transpose(1, 2).reshape(-1)
        permute = torch.eye(rows)[order]
        blocks = [patch.strength * r + (1 - patch.strength) * eye for r in rotations[stage]]
        product = permute.T @ torch.block_diag(*blocks) @ permute @ product
    rotated = (product @ w.flatten(1)).reshape(w.shape)
    if "rescale" in t:
        rotated = rotated * t["rescale"]
    return w + patch.strength * (rotated - w)


def reference(weight: torch.Tensor, patches) -> torch.Tensor:
    """Patches in order, each on its offset's rows (dim 0) or the whole weight."""
    w = weight.float().clone()
    for patch in patches:
        if patch.offset is None:
            w = reference_delta_free(w, patch)
        else:
            dim, start, length = patch.offset
            part = w.narrow(dim, start, length)
            part.copy_(reference_delta_free(part, patch))
    return w


def random_patch(kind: str, shape: tuple[int, int], seed: int, **scalars) -> WeightPatch:
    """A patch of `kind` for a [rows, columns] weight with random tensors of a sensible size."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = shape

    def r(*size, scale=0.2):
        return torch.randn(*size, generator=g) * scale
    tensors = {
        "lora": lambda: {"up": r(rows, 3), "down": r(3, cols)},
        "loha": lambda: {"w1a": r(rows, 2), "w1b": r(2, cols), "w2a": r(rows, 2), "w2b": r(2, cols)},
        "lokr": lambda: {"w1": r(2, 2, scale=1.0), "w2a": r(rows // 2, 3), "w2b": r(3, cols // 2)},
        "glora": lambda: {"a1": r(cols, 3), "a2": r(3, cols), "b1": r(rows, 3), "b2": r(3, cols)},
        "oft": lambda: {"blocks": r(rows // 4, 4, 4)},
        "boft": lambda: {"blocks": r(2, rows // 4, 4, 4), "rescale": 1.0 + r(rows, 1, scale=0.05)},
        "diff": lambda: {"diff": r(rows, cols, scale=0.05)},
        "set": lambda: {"value": r(rows, cols)},
    }[kind]()
    return WeightPatch(kind, tensors, **scalars)
