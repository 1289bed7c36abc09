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


# Signature keys of model families (and non-model files) that no detector above handles, for the error message.
OTHER_KINDS = {
    "Flux.2": ("double_stream_modulation_img.lin.weight", "single_stream_modulation.lin.weight"),
    "Chroma": ("distilled_guidance_layer.in_proj.weight", "distilled_guidance_layer.in_proj.bias"),
    "Qwen-Image 2.1": ("txt_in.text_norm.weight",),
    "Wan": ("head.modulation", "condition_embedder.time_proj.weight"),
    "HunyuanVideo": ("txt_in.individual_token_refiner.blocks.0.adaLN_modulation.1.bias",),
    "SD3 / SD3.5": ("joint_blocks.0.context_block.attn.qkv.weight",),
    "SDXL / SD1.x UNet": ("input_blocks.0.0.weight", "down_blocks.0.resnets.0.conv1.weight"),
    "LTX-Video": ("patchify_proj.weight",),
    "HiDream": ("double_stream_blocks.0.block.adaLN_modulation.1.bias",),
    "Lumina 2 / Z-Image": ("cap_embedder.0.weight", "layers.0.adaLN_modulation.0.weight"),
    "a VAE": ("decoder.conv_in.weight", "decoder.conv_in.conv.weight", "decoder.middle.0.residual.0.gamma"),
    "a text encoder": ("encoder.block.0.layer.0.SelfAttention.q.weight", "text_model.encoder.layers.0.mlp.fc1.weight",
                       "model.layers.0.self_attn.q_proj.weight"),
    "a LoRA": ("lora_down.weight", "lora_A.weight", "lora_up.weight"),
}


def detect(path: str) -> Detection:
    """Family of a checkpoint file or diffusers folder; the model families' own detectors are tried in turn."""
    from .checkpoint import read_checkpoint_header
    header = read_checkpoint_header(path)
    family = header.metadata.get(FAMILY_METADATA_KEY)
    if family:
        return Detection(family=family, config=json.loads(header.metadata.get("ulysses_sp.config", "{}")),
                         files=(path,))
    supported = []
    for module_name in DETECTORS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name != module_name:
                raise
            continue
        supported.append(getattr(module, "DESCRIPTION", module_name.rsplit(".", 1)[-1]))
        detection = module.detect(header)
        if detection is not None:
            return detection
    raise ValueError(f"{path!r}: no supported model family recognised. {describe_unknown(header)} "
                     f"Supported: {'; '.join(supported)}")


def describe_unknown(header: Header) -> str:
    """What an unrecognised checkpoint looks like: a known other family, or a summary of its tensors."""
    if not header.tensors:
        return "The file holds no tensors."
    for kind, signatures in OTHER_KINDS.items():
        hits = [key for key in header.tensors if key.endswith(signatures)]
        if hits:
            return f"It looks like {kind} (it has {hits[0]!r}), which is not supported."
    groups: dict[str, int] = {}
    for key in header.tensors:
        stem = key.split(".", 1)[0]
        groups[stem] = groups.get(stem, 0) + 1
    top = ", ".join(f"{stem} ({count})" for stem, count in sorted(groups.items(), key=lambda g: -g[1])[:8])
    return f"It holds {len(header.tensors)} tensors, grouped as: {top}; e.g. {sorted(header.tensors)[:3]}."
