"""Detection of a checkpoint's family, variant, key layout and architecture from its safetensors header alone."""
from __future__ import annotations

import importlib
import json
import os
import struct
from dataclasses import dataclass, field

FAMILY_METADATA_KEY = "ulysses_sp.family"  # set only by this project's own test / demo checkpoints
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass
class Header:
    """Tensor names, shapes and dtypes of a safetensors file, read without touching the weights."""

    path: str
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # name -> (safetensors dtype, shape)
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass
class Detection:
    family: str
    variant: str = ""
    layout: str = ""       # "original" (ComfyUI / reference keys) or "diffusers"
    prefix: str = ""       # stripped from every key, e.g. "model.diffusion_model."
    config: dict = field(default_factory=dict)
    files: tuple[str, ...] = ()


def read_header(path: str) -> Header:
    """Parse one .safetensors header; raise ValueError naming the file when it is not one."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path!r} is not a safetensors checkpoint: the file has only {size} bytes")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{path!r} is not a safetensors checkpoint (header length {length} does not fit "
                             f"in a {size}-byte file): give a .safetensors file")
        try:
            raw = json.loads(handle.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{path!r} is not a safetensors checkpoint: its header is not JSON ({error})") from None
    metadata = raw.pop("__metadata__", None) or {}
    tensors = {}
    for name, entry in raw.items():
        begin, end = entry["data_offsets"]
        if end > size - 8 - length:
            raise ValueError(f"{path!r} is truncated: tensor {name!r} ends at byte {end} of the data but the file "
                             f"holds {size - 8 - length}; download or copy it again")
        tensors[name] = (entry["dtype"], tuple(entry["shape"]))
    return Header(path, tensors, metadata)


# Each family module has `detect(header) -> Detection | None` and imports diffusers only inside its loader,
# so detection stays cheap in the ComfyUI process.
DETECTORS = [
    "sp_runtime.families.qwen_image",
    "sp_runtime.families.flux",
    "sp_runtime.families.wan",
]


def detect(path: str) -> Detection:
    """Family of a checkpoint file; the model families' own detectors are tried in turn."""
    header = read_header(path)
    family = header.metadata.get(FAMILY_METADATA_KEY)
    if family:
        return Detection(family=family, config=json.loads(header.metadata.get("ulysses_sp.config", "{}")),
                         files=(path,))
    for module_name in DETECTORS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name != module_name:
                raise
            continue
        detection = module.detect(header)
        if detection is not None:
            return detection
    raise ValueError(f"{path!r}: no supported model family recognised")
