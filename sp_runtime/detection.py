"""Which family a checkpoint is, from its header alone: the registered families' detectors tried in turn, and a
clear description of anything none of them recognises."""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Optional, Union

from .checkpoints.header import FAMILY_METADATA_KEY, Header, read_checkpoint_header
from .contract import Detection
from .families import FAMILIES, descriptions, families, family, gguf_architectures, signatures
from .formats.detect import plain_view
from .formats.gguf_file import METADATA_ARCHITECTURE

# This project's own test / benchmark families: a file naming one in its metadata would make every worker build what
# the metadata asks for (the synthetic family draws random weights of any size). They load only in a process that
# opted in (importing sp_lab.families, which registers them; allow_internal_families); never from metadata.
INTERNAL_FAMILIES = ("toy", "synthetic")
INTERNAL_FAMILIES_ENV = "ULYSSES_SP_INTERNAL_FAMILIES"

# Signature keys of model families (and non-model files) that no registered family handles, for the error message.
# Consulted only when no registered family recognised the file, after the registered families' own signatures
# (Family.signatures): a newly registered family needs no change here.
OTHER_KINDS = {
    "HunyuanImage 2.1": ("byt5_in.fc1.weight",),
    "SDXL / SD1.x UNet": ("input_blocks.0.0.weight", "down_blocks.0.resnets.0.conv1.weight"),
    "Flux.3": ("early_stream_modulations.image.lin.weight",),  # diffusers' CHECKPOINT_KEY_NAMES["flux3"]
    "Bria FIBO 2": ("perceiver.latent_queries",),  # diffusers' name; ComfyUI's model code is in no stored tree
    # PiD (pixel diffusion decoder of Flux.1 latents) is PixelDiT with a latent projection, so before PixelDiT
    "PiD (PixelDiT latent decoder)": ("lq_proj.latent_proj.0.weight",),
    "PixelDiT": ("core.pixel_embedder.proj.weight",),
    "a VAE": ("decoder.conv_in.weight", "decoder.conv_in.conv.weight", "decoder.middle.0.residual.0.gamma"),
    "a text encoder": ("encoder.block.0.layer.0.SelfAttention.q.weight", "text_model.encoder.layers.0.mlp.fc1.weight",
                       "model.layers.0.self_attn.q_proj.weight"),
    "a LoRA": ("lora_down.weight", "lora_A.weight", "lora_up.weight"),
}


def allow_internal_families() -> None:
    """Let this process (and the workers it starts) load the toy / synthetic families: for test and benchmark code
    that writes such files itself. Nothing read from a file can call this."""
    os.environ[INTERNAL_FAMILIES_ENV] = "1"


def internal_families_allowed() -> bool:
    return os.environ.get(INTERNAL_FAMILIES_ENV) == "1"


def detect(checkpoint: Union[str, Header], allow_internal: Optional[bool] = None) -> Detection:
    """Family of a checkpoint (a path, or its header already read); ValueError saying what the file is otherwise.

    allow_internal: whether the toy / synthetic families may load (None: only when this process opted in)."""
    header = checkpoint if isinstance(checkpoint, Header) else read_checkpoint_header(checkpoint)
    named = header.metadata.get(FAMILY_METADATA_KEY)
    if named:
        allowed = internal_families_allowed() if allow_internal is None else allow_internal
        if named in INTERNAL_FAMILIES and not allowed:
            raise ValueError(f"{header.path!r} names the model family {named!r} in its metadata "
                             f"({FAMILY_METADATA_KEY}): that is ulysses-sp's own test / benchmark model, which "
                             f"loads only in test and benchmark runs ({INTERNAL_FAMILIES_ENV}=1), never from a "
                             f"file's word; a downloaded model does not need it, so this file is not a real model")
        return _detect_named(header, named)
    view = plain_view(header)
    for entry in families():
        detection = entry.detect(view)
        if detection is not None:
            return _with_quantization(detection, header)
    raise ValueError(f"{header.path!r}: no supported model family recognised. {describe_unknown(header)} "
                     f"Supported: {'; '.join(descriptions())}")


def _with_quantization(detection: Detection, header: Header) -> Detection:
    """The detection with the file's quantized format (checked to be one we dequantize)."""
    from .checkpoints.loading import check_quantization
    quant = check_quantization(header, detection.prefix)
    return replace(detection, quant=quant.summary()) if quant else detection


def _detect_named(header: Header, name: str) -> Detection:
    """Our own checkpoints (toy, synthetic specs) name their family in the metadata."""
    if name not in FAMILIES:
        raise ValueError(f"{header.path!r} names the model family {name!r} in its metadata "
                         f"({FAMILY_METADATA_KEY}), which this version of ulysses-sp does not know (known: "
                         f"{', '.join(FAMILIES)}); write the file again with a known family")
    detection = family(name).detect(header)
    if detection is None:
        raise ValueError(f"{header.path!r} names the model family {name!r} but is not a valid {name} file")
    return detection


def describe_unknown(header: Header) -> str:
    """What an unrecognised checkpoint looks like: a known other family, or a summary of its tensors."""
    if not header.tensors:
        return "The file holds no tensors."
    for kind, keys in signatures().items():
        hits = [key for key in header.tensors if key.endswith(keys)]
        if hits:
            return (f"It looks like {kind} (it has {hits[0]!r}), but lacks tensors every such file has: it is "
                    f"incomplete, or a variant this version cannot run.")
    for kind, keys in OTHER_KINDS.items():
        hits = [key for key in header.tensors if key.endswith(keys)]
        if hits:
            return f"It looks like {kind} (it has {hits[0]!r}), which is not supported."
    groups: dict[str, int] = {}
    for key in header.tensors:
        stem = key.split(".", 1)[0]
        groups[stem] = groups.get(stem, 0) + 1
    top = ", ".join(f"{stem} ({count})" for stem, count in sorted(groups.items(), key=lambda g: -g[1])[:8])
    return (f"It holds {len(header.tensors)} tensors, grouped as: {top}; e.g. {sorted(header.tensors)[:3]}."
            f"{_gguf_note(header)}")


def _gguf_note(header: Header) -> str:
    """For a GGUF file of an architecture no registered family reads: which ones they read."""
    architecture, known = header.metadata.get(METADATA_ARCHITECTURE), gguf_architectures()
    if not architecture or architecture in known:
        return ""
    return f" Its GGUF architecture is {architecture!r}; GGUF files of {', '.join(sorted(known))} load here."

