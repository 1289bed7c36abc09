"""LoRA files: the adapters a .safetensors LoRA holds, found from its header alone, and each adapter's weight delta.

Tensor names follow the formats ComfyUI's `comfy/weight_adapter/lora.py` and `comfy/lora.py` read: low-rank pairs
(`lora_up`/`lora_down` with an optional `.alpha` (kohya), `lora_B`/`lora_A` (diffusers / peft), `.lora.up`,
`_lora.up`, `.lora_B.default`, `.lora_linear_layer.up`, mochi's bare `.lora_B`) and full differences (`.diff`,
`.diff_b` for biases, `.w_norm` / `.b_norm`). Other adapter types (LoHa, LoKr, OFT, DoRA, LoCon mid weights) are
refused by name rather than half-applied.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..checkpoints.header import read_header, require_regular_file

# (suffix of the up / B tensor, suffix of the down / A tensor), as comfy/weight_adapter/lora.py lists them
LOW_RANK_SUFFIXES = (
    (".lora_up.weight", ".lora_down.weight"),
    ("_lora.up.weight", "_lora.down.weight"),
    (".lora_B.weight", ".lora_A.weight"),
    (".lora.up.weight", ".lora.down.weight"),
    (".lora_B.default.weight", ".lora_A.default.weight"),
    (".lora_linear_layer.up.weight", ".lora_linear_layer.down.weight"),
    (".lora_B", ".lora_A"),
)
# suffix -> the parameter kind a full difference changes
DIFF_SUFFIXES = {".diff": "weight", ".w_norm": "weight", ".diff_b": "bias", ".b_norm": "bias"}
ALPHA_SUFFIX = ".alpha"
# tensor name parts of adapter types we do not apply -> their name for the error
UNSUPPORTED = {".dora_scale": "DoRA", ".lora_mid.weight": "LoCon with mid weights (Tucker)", ".hada_w1_a": "LoHa",
               ".lokr_w1": "LoKr", ".lokr_w1_a": "LoKr", ".oft_blocks": "OFT", ".oft_diag": "OFT",
               ".boft_blocks": "BOFT", ".set_weight": "weight replacement (set_weight)",
               ".reshape_weight": "a Flux control LoRA (reshape_weight)"}
# module name starts of text-encoder parts: a LoRA for the diffusion model only skips them, as ComfyUI's
# LoraLoaderModelOnly does (it logs them as "lora key not loaded")
TEXT_ENCODER_STARTS = ("lora_te", "text_encoder", "text_encoders.", "te1.", "te2.", "te.", "lora_clip")


@dataclass(frozen=True)
class Adapter:
    """One entry of a LoRA file: the module it names (as the file spells it) and the tensors that make its delta."""

    module: str                          # e.g. "lora_unet_double_blocks_0_img_attn_qkv"
    kind: str                            # the parameter it changes: "weight" or "bias"
    up: str                              # the up / B tensor, or the full difference
    down: Optional[str] = None           # the down / A tensor (None: `up` is a full difference)
    alpha: Optional[float] = None        # kohya alpha: the delta is scaled by alpha / rank
    shape: tuple[int, ...] = ()          # shape of the delta: [out, in] (in flattened) for low rank
    rank: int = 0

    @property
    def scale(self) -> float:
        """alpha / rank for low-rank adapters with an alpha (as ComfyUI computes it), else 1."""
        return 1.0 if self.alpha is None or self.down is None else self.alpha / self.rank


@dataclass
class LoraFile:
    """The parsed header of one LoRA file; `identity` changes when the file on disk does."""

    path: str
    identity: tuple
    adapters: list[Adapter] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # text-encoder modules


def file_identity(path: str) -> tuple:
    """(real path, size, mtime): a rewritten file is a different LoRA."""
    require_regular_file(path, "LoRA file")
    stat = os.stat(path)
    return os.path.realpath(path), stat.st_size, stat.st_mtime_ns


def read_lora_file(path: str) -> LoraFile:
    """Adapters of a LoRA file from its header (alphas are the only tensors read); clear errors for other files."""
    identity = file_identity(path)
    try:
        header = read_header(path)
    except ValueError as error:
        raise ValueError(f"LoRA {path!r} cannot be read: {error} (only .safetensors LoRA files load)") from None
    if not header.tensors:
        raise ValueError(f"LoRA {path!r} holds no tensors")
    _refuse_unsupported(path, header.tensors)
    alphas = _read_alphas(path, [key for key in header.tensors if key.endswith(ALPHA_SUFFIX)])
    parsed = LoraFile(path, identity)
    used = set(alphas)
    for key in header.tensors:
        try:
            adapter = _adapter_from(key, header.tensors, alphas)
        except ValueError as error:
            raise ValueError(f"LoRA {path!r}: {error}") from None
        if adapter is None:
            continue
        used.update(name for name in (adapter.up, adapter.down) if name)
        if adapter.module.startswith(TEXT_ENCODER_STARTS):
            parsed.skipped.append(adapter.module)
        else:
            parsed.adapters.append(adapter)
    leftover = sorted(set(header.tensors) - used)
    if leftover:
        raise ValueError(f"LoRA {path!r} has {len(leftover)} tensors in no known LoRA format (e.g. {leftover[:4]}); "
                         f"supported: lora_up/lora_down(+alpha), lora_A/lora_B, .diff, .diff_b")
    if not parsed.adapters:
        what = "only text-encoder weights" if parsed.skipped else "no LoRA weights"
        raise ValueError(f"LoRA {path!r} has {what} for the diffusion model: nothing to apply")
    return parsed


def _refuse_unsupported(path: str, tensors: dict) -> None:
    for key in tensors:
        for part, name in UNSUPPORTED.items():
            if key.endswith(part) or (part + ".") in key:
                raise ValueError(f"LoRA {path!r} is a {name} adapter (it has {key!r}), which ulysses-sp does not "
                                 f"apply; plain LoRA (lora_up/lora_down, lora_A/lora_B) and .diff files work")


def _read_alphas(path: str, keys: list[str]) -> dict[str, float]:
    if not keys:
        return {}
    from safetensors import safe_open
    with safe_open(path, framework="pt", device="cpu") as handle:
        return {key: float(handle.get_tensor(key).float().reshape(-1)[0]) for key in keys}


def _adapter_from(key: str, tensors: dict, alphas: dict[str, float]) -> Optional[Adapter]:
    """The adapter whose up (or diff) tensor `key` is; None for down tensors, alphas and unknown names."""
    for up_suffix, down_suffix in LOW_RANK_SUFFIXES:
        if key.endswith(up_suffix):
            module = key[: -len(up_suffix)]
            down = module + down_suffix
            if down not in tensors:
                raise ValueError(f"LoRA tensor {key!r} has no matching {down!r}: the file is incomplete")
            up_shape, down_shape = tuple(tensors[key][1]), tuple(tensors[down][1])
            if down_shape[:1] == (0,):
                raise ValueError(f"LoRA tensors {key!r} {list(up_shape)} and {down!r} {list(down_shape)} have rank 0: "
                                 f"the file is damaged (a LoRA's rank is at least 1)")
            if len(up_shape) < 2 or len(down_shape) < 2 or up_shape[1] != down_shape[0]:
                raise ValueError(f"LoRA tensors {key!r} {list(up_shape)} and {down!r} {list(down_shape)} do not "
                                 f"multiply (rank mismatch)")
            if any(size != 1 for size in up_shape[2:]):
                raise ValueError(f"LoRA tensor {key!r} has shape {list(up_shape)}: an up tensor is [out, rank] (a "
                                 f"conv's [out, rank, 1, 1]); the file is malformed or in a format we do not apply")
            inner = 1
            for size in down_shape[1:]:
                inner *= size
            return Adapter(module, "weight", key, down, alphas.get(module + ALPHA_SUFFIX), (up_shape[0], inner),
                           down_shape[0])
    for suffix, kind in DIFF_SUFFIXES.items():
        if key.endswith(suffix):
            return Adapter(key[: -len(suffix)], kind, key, shape=tuple(tensors[key][1]))
    return None


def adapter_delta(handle, adapter: Adapter) -> torch.Tensor:
    """The adapter's delta in float32 on the handle's device, before `strength x adapter.scale`: up @ down
    (flattened to [out, in]), or the difference itself. `handle` is an open safetensors file."""
    first, up = adapter_factors(handle, adapter)
    return first if up is None else up @ first


def adapter_factors(handle, adapter: Adapter) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(down [rank, in], up [out, rank]) of a low-rank adapter, or (difference, None), in float32."""
    if adapter.down is None:
        return handle.get_tensor(adapter.up).float(), None
    return (handle.get_tensor(adapter.down).float().flatten(1), handle.get_tensor(adapter.up).float().flatten(1))
