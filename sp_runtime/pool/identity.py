"""Which file a joined machine loads for the host's model or LoRA: the file of the same name in its own models
folder, accepted only when its identity (name, size and a hash of its header of every file the load reads) equals
the host's: a different file is a clear error, never a wrong picture.
"""
from __future__ import annotations

import hashlib
import os
import struct
from functools import lru_cache

from ..checkpoints.header import resolve_checkpoint

HEAD_BYTES = 1 << 20  # files that are not safetensors: their first MiB is their header's stand-in


class IdentityMismatch(ValueError):
    """The joined machine's file is not the host's file."""


def file_identity(path: str) -> dict:
    """{"name", "files": [[name, size, sha256 of the header], ...]} of a checkpoint (file or folder) or LoRA."""
    path = os.path.realpath(path)
    files = _files_of(path)
    stamps = tuple((file, os.stat(file).st_size, os.stat(file).st_mtime_ns) for file in files)
    return _identity(path, stamps)


@lru_cache(maxsize=64)
def _identity(path: str, stamps: tuple) -> dict:
    return {"name": os.path.basename(path),
            "files": [[os.path.basename(file), size, header_hash(file)] for file, size, _ in stamps]}


def _files_of(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    source = resolve_checkpoint(path)
    return list(source.files) + ([os.path.join(source.path, "config.json")] if source.config is not None else [])


def header_hash(path: str) -> str:
    """sha256 of a safetensors file's header (its 8-byte length and JSON), or of another file's first MiB."""
    with open(path, "rb") as handle:
        head = handle.read(8)
        if path.endswith(".safetensors") and len(head) == 8:
            length = struct.unpack("<Q", head)[0]
            body = handle.read(min(length, 256 << 20))
        else:
            body = handle.read(HEAD_BYTES - len(head))
    return hashlib.sha256(head + body).hexdigest()


def find_local(identity: dict, models_dir: str, machine: str) -> str:
    """This machine's copy of the host's file: the one of that name under models_dir, checked against identity."""
    name = identity["name"]
    if not models_dir:
        raise IdentityMismatch(f"machine {machine!r} has no models folder: join with --models <folder holding {name}>")
    matches = []
    for folder, dirs, files in os.walk(models_dir, followlinks=True):
        matches.extend(os.path.join(folder, entry) for entry in files + dirs if entry == name)
    if not matches:
        raise IdentityMismatch(f"machine {machine!r} has no {name!r} under its models folder {models_dir}: copy the "
                               f"host's file there")
    if len(matches) > 1:
        raise IdentityMismatch(f"machine {machine!r} has {len(matches)} files named {name!r} under {models_dir} "
                               f"({matches[:3]}): keep one")
    local = file_identity(matches[0])
    if local != identity:
        raise IdentityMismatch(f"machine {machine!r}: {matches[0]} is not the host's {name!r} (here "
                               f"{_describe(local)}, on the host {_describe(identity)}): copy the host's file")
    return matches[0]


def _describe(identity: dict) -> str:
    return ", ".join(f"{name}: {size} bytes, header {digest[:12]}" for name, size, digest in identity["files"])
