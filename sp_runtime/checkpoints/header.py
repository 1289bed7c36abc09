"""Checkpoint files and their safetensors headers: which files a checkpoint path means, and the tensor names, shapes
and dtypes they hold, read without touching the weights. Every bad file gets an error naming its path and the fix.
"""
from __future__ import annotations

import glob
import json
import math
import os
import stat
import struct
from dataclasses import dataclass, field
from typing import Optional

# The largest released checkpoints have headers well under 2 MiB (thousands of tensors); safetensors' own cap is
# 100 MB, which takes seconds and gigabytes to parse as JSON: a header beyond this is refused before it is read.
MAX_HEADER_BYTES = 16 * 1024 * 1024
FAMILY_METADATA_KEY = "ulysses_sp.family"  # set only by this project's own test / demo / benchmark checkpoints
CONFIG_METADATA_KEY = "diffusers.config"  # a folder's config.json, carried in the merged Header's metadata
# dtype names of the safetensors format (safetensors' Dtype enum) -> bits per element (Dtype::bitsize)
SAFETENSORS_DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32,
                          "U32": 32, "F32": 32, "F64": 64, "I64": 64, "U64": 64, "F8_E4M3": 8, "F8_E5M2": 8,
                          "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "C64": 64}
SAFETENSORS_DTYPE_NAMES = frozenset(SAFETENSORS_DTYPE_BITS)
FORMAT_HINT = "give a .safetensors file or a diffusers model folder (config.json + .safetensors)"


@dataclass
class Header:
    """Tensor names, shapes and dtypes of a safetensors file (or a folder's shards), without the weights."""

    path: str
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # name -> (safetensors dtype, shape)
    metadata: dict[str, str] = field(default_factory=dict)
    files: tuple[str, ...] = ()  # the weight files (one, or a folder's shards); () = just `path`

    def to_dict(self) -> dict:
        """JSON-ready form (the host sends it to the workers with a load request)."""
        return {"path": self.path, "tensors": {name: [dtype, list(shape)] for name, (dtype, shape)
                                               in self.tensors.items()},
                "metadata": dict(self.metadata), "files": list(self.files)}

    @classmethod
    def from_dict(cls, data: dict) -> "Header":
        return cls(data["path"], {name: (dtype, tuple(shape)) for name, (dtype, shape) in data["tensors"].items()},
                   dict(data["metadata"]), tuple(data.get("files", ())))

    @property
    def source(self) -> "CheckpointSource":
        """The files load_weights reads."""
        return CheckpointSource(self.path, self.files or (self.path,))


@dataclass(frozen=True)
class CheckpointSource:
    """A checkpoint on disk: one .safetensors file, or a diffusers folder (config.json + one file or shards)."""

    path: str
    files: tuple[str, ...]
    config: Optional[dict] = None  # the folder's config.json; None for a single file


def resolve_checkpoint(path: str) -> CheckpointSource:
    """Files of a checkpoint path; a pipeline folder with a transformer/ subfolder resolves to that subfolder."""
    path = os.path.abspath(os.path.expanduser(str(path)))
    kind = file_kind(path)
    if kind == "file":
        _refuse_other_formats(path)
        return CheckpointSource(path, (path,))
    if kind == "missing":
        raise FileNotFoundError(f"checkpoint {path!r} does not exist: {FORMAT_HINT}")
    if kind != "folder":
        raise ValueError(f"checkpoint {path!r} {kind}: {FORMAT_HINT}")
    if not os.path.isfile(os.path.join(path, "config.json")) and os.path.isdir(os.path.join(path, "transformer")):
        return resolve_checkpoint(os.path.join(path, "transformer"))
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"folder {path!r} has no config.json: a diffusers model folder holds config.json and "
                         f".safetensors weights; or give the .safetensors file itself")
    config = read_json(config_path, "a diffusers config.json")
    if not isinstance(config, dict):
        raise ValueError(f"{config_path!r} is not a diffusers config.json (it holds a {type(config).__name__}, "
                         f"not an object); copy the model folder again")
    return CheckpointSource(path, _folder_weight_files(path), config)


def file_kind(path: str) -> str:
    """'file', 'folder', 'missing', or what else the path is, worded for an error ('is a FIFO', ...)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "is a broken symbolic link" if os.path.islink(path) else "missing"
    except OSError as error:  # ELOOP (a symbolic link loop), EACCES, ENAMETOOLONG ...
        return f"cannot be opened ({error.strerror or error})"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "folder"
    for test, name in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return f"is {name}, not a regular file"
    return "is not a regular file"


def require_regular_file(path: str, what: str = "checkpoint") -> None:
    """FileNotFoundError when nothing is there; ValueError saying what else the path is (never opened: a FIFO
    would block)."""
    kind = file_kind(path)
    if kind == "missing":
        raise FileNotFoundError(f"{what} {path!r} does not exist")
    if kind != "file":
        raise ValueError(f"{what} {path!r} {'is a folder' if kind == 'folder' else kind}: give a .safetensors file")


def read_json(path: str, what: str):
    """A small JSON file of a model folder; errors name the file."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path!r} is not valid JSON ({error}); it should be {what}: copy the model folder "
                         f"again") from None


def _folder_weight_files(folder: str) -> tuple[str, ...]:
    indexes = sorted(glob.glob(os.path.join(folder, "*.safetensors.index.json")))
    if indexes:
        index = read_json(indexes[0], "a safetensors shard index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
            raise ValueError(f"{indexes[0]!r} has no valid 'weight_map' (tensor name -> shard file); copy the "
                             f"model folder again")
        files = sorted({os.path.join(folder, name) for name in weight_map.values()})
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"{indexes[0]!r} lists shards that are missing: {missing[:3]}; copy the whole "
                                    f"folder again")
        return tuple(files)
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"folder {folder!r} has config.json but no .safetensors weights (only .safetensors loads)")
    return tuple(files)


def _refuse_other_formats(path: str) -> None:
    """Clear errors for the other weight formats people keep next to .safetensors files."""
    with open(path, "rb") as handle:
        magic = handle.read(9)
    if magic[8:9] == b"{" or magic[:4] == b"GGUF":  # safetensors (its 8-byte length may start with 0x80 or "PK")
        return
    if magic[:2] == b"PK" or magic[:1] == b"\x80":  # zip (torch.save) or a raw pickle
        raise ValueError(f"{path!r} is a pickled (.ckpt/.pt/.bin) checkpoint: only .safetensors files load "
                         f"(pickles can run code); convert it to .safetensors first")


def read_header(path: str) -> Header:
    """Parse one .safetensors file's header (or a GGUF file's tensor table); ValueError naming the file and what is
    wrong when it is neither."""
    require_regular_file(path)
    from ..formats import gguf_file
    if gguf_file.is_gguf(path):
        from ..formats.detect import CONTAINER_KEY
        tensors, metadata = gguf_file.read_tensor_table(path)
        return Header(path, tensors, {**metadata, CONTAINER_KEY: "gguf"}, (path,))
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path!r} is not a safetensors checkpoint: the file has only {size} bytes")
        (length,) = struct.unpack("<Q", prefix)
        if MAX_HEADER_BYTES < length <= size - 8:
            raise ValueError(f"{path!r}: its safetensors header is {length} bytes, more than the limit of "
                             f"{MAX_HEADER_BYTES} (released checkpoints stay under 2 MiB); this file is not a "
                             f"checkpoint ulysses-sp loads")
        if length > size - 8:
            raise ValueError(f"{path!r} is not a safetensors checkpoint (header length {length} does not fit "
                             f"in a {size}-byte file): give a .safetensors file")
        try:
            raw = json.loads(handle.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{path!r} is not a safetensors checkpoint: its header is not JSON ({error})") from None
    if not isinstance(raw, dict):
        raise _damaged(path, f"its header is a JSON {type(raw).__name__}, not an object")
    metadata = raw.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _damaged(path, "its __metadata__ is not a map of strings")
    data_bytes = size - 8 - length
    tensors = {name: _tensor_entry(path, name, entry, data_bytes) for name, entry in raw.items()}
    _check_no_overlap(path, {name: entry["data_offsets"] for name, entry in raw.items()})
    return Header(path, tensors, metadata, (path,))


def _tensor_entry(path: str, name: str, entry, data_bytes: int) -> tuple[str, tuple[int, ...]]:
    """(dtype, shape) of one header entry, checked against the safetensors format."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise _damaged(path, f"tensor {name!r} has no dtype / shape / data_offsets entry")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in SAFETENSORS_DTYPE_NAMES:
        raise _damaged(path, f"tensor {name!r} has the unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise _damaged(path, f"tensor {name!r} has the invalid shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise _damaged(path, f"tensor {name!r} has invalid data_offsets {offsets!r}")
    if offsets[1] > data_bytes:
        raise ValueError(f"{path!r} is truncated: tensor {name!r} ends at byte {offsets[1]} of the data but the "
                         f"file holds {data_bytes}; download or copy it again")
    bits = math.prod(shape) * SAFETENSORS_DTYPE_BITS[dtype]
    if bits != 8 * (offsets[1] - offsets[0]):
        raise _damaged(path, f"tensor {name!r} claims shape {shape} of {dtype} ({bits / 8:g} bytes) but its "
                             f"data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes")
    return dtype, tuple(shape)


def _check_no_overlap(path: str, ranges: dict[str, list[int]]) -> None:
    """Every byte of the data belongs to at most one tensor (the ranges are known to lie inside the file)."""
    from ..formats.byte_ranges import first_overlap
    overlap = first_overlap((begin, end, name) for name, (begin, end) in ranges.items())
    if overlap:
        raise _damaged(path, f"tensors {overlap[0]!r} and {overlap[1]!r} overlap in the file")


def _damaged(path: str, problem: str) -> ValueError:
    return ValueError(f"{path!r} is not a valid safetensors checkpoint: {problem}; download or copy it again")


def read_checkpoint_header(path: str) -> Header:
    """Header of a file, or of a diffusers folder (shards merged; config.json under CONFIG_METADATA_KEY)."""
    source = resolve_checkpoint(path)
    if source.config is None:
        return read_header(source.files[0])
    tensors: dict = {}
    for file in source.files:
        tensors.update(read_header(file).tensors)
    return Header(source.path, tensors, {CONFIG_METADATA_KEY: json.dumps(source.config)}, source.files)


def header_config(header: Header) -> Optional[dict]:
    """The diffusers config.json of a folder header, or None for a single file."""
    text = header.metadata.get(CONFIG_METADATA_KEY)
    return json.loads(text) if text else None


def checkpoint_stamp(path: str) -> list[list[int]]:
    """[inode, size, mtime_ns] of every file a load of `path` reads: another stamp means other weights."""
    source = resolve_checkpoint(path)
    config = (os.path.join(source.path, "config.json"),) if source.config is not None else ()
    return [[info.st_ino, info.st_size, info.st_mtime_ns] for info in map(os.stat, source.files + config)]


def check_unchanged(path: str, stamp: list) -> None:
    """Refuse to read a checkpoint that changed on disk since the host chose it (its weights would not be the ones
    asked for)."""
    if checkpoint_stamp(path) != [list(entry) for entry in stamp]:
        raise ValueError(f"{path!r} changed on disk after it was chosen for loading (replaced or rewritten): "
                         f"load it again")


def read_file_tensor(path: str, name: str):
    """One tensor of a checkpoint by its name with or without a prefix (`model.diffusion_model.positive_conditioning`
    for `positive_conditioning`), read through safetensors' mmap alone: the host's way to the few non-weight tensors
    ComfyUI's nodes read from the model (ComfyHost.file_tensors). KeyError naming the file when it has none."""
    from safetensors import safe_open
    for file in resolve_checkpoint(path).files:
        with safe_open(file, framework="pt") as handle:
            for key in handle.keys():
                if key == name or key.endswith("." + name):
                    return handle.get_tensor(key)
    raise KeyError(f"{path} holds no tensor {name!r}")
