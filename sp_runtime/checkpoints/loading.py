"""Checkpoint loading shared by every model family: files and key prefixes, dtype policy, and weights read once.

Flow in a worker: `source = header.source` -> `dtypes = choose_dtypes(request.dtype, header)` ->
`model = build_empty_model(cls, config, dtypes)` -> `load_weights(model, source, prefix=..., plan=..., ...)`.
Each tensor is read once with safetensors (mmap) straight onto the worker's device and cast to its final dtype as
soon as it is read, so loading never holds more than the final model plus one source tensor.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional, Sequence

import torch

from .dtypes import DTYPES, dtype_name
from .header import CheckpointSource, Header, header_config, read_checkpoint_header
from .kept import cast_weight, out_of_file

# Prefixes under which real checkpoints keep the diffusion model, most specific first. ComfyUI's full checkpoints use
# "model.diffusion_model."; some exporters write "diffusion_model." or "model."; diffusers pipelines "transformer.".
KNOWN_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "model.", "transformer.", "")

SAFETENSORS_DTYPES = {  # safetensors header dtype -> torch dtype
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_COMPUTE_DTYPE = torch.bfloat16
QUANTIZED_COMPUTE_DTYPE = torch.bfloat16

ProgressFn = Callable[[float, str], None]

# target key -> function of the source tensor (None: the tensor itself)
Transform = Optional[Callable[[torch.Tensor], torch.Tensor]]
# source key (prefix stripped) -> the model keys made from it; lets one source tensor feed several parameters
KeyPlan = Mapping[str, Sequence[tuple[str, Transform]]]


# ---------------------------------------------------------------------------------------------------------------
# Key prefixes and header inspection

def find_prefix(keys: Iterable[str], anchors: Sequence[str]) -> Optional[str]:
    """The prefix p for which p + anchor is a key for every anchor, or None.

    Known prefixes (KNOWN_PREFIXES) are preferred; any other prefix ending in "." is accepted too.
    """
    keys = keys if isinstance(keys, (set, dict)) else set(keys)
    first = anchors[0]
    candidates = {key[: len(key) - len(first)] for key in keys if key.endswith(first)}
    candidates = {p for p in candidates if p == "" or p.endswith(".")}
    ordered = [p for p in KNOWN_PREFIXES if p in candidates] + sorted(candidates - set(KNOWN_PREFIXES), key=len)
    for prefix in ordered:
        if all(prefix + anchor in keys for anchor in anchors):
            return prefix
    return None


def strip_prefix(tensors: Mapping[str, tuple], prefix: str) -> dict[str, tuple]:
    """Entries under `prefix`, with the prefix removed (other entries, e.g. a VAE in the same file, are dropped)."""
    return {key[len(prefix):]: value for key, value in tensors.items() if key.startswith(prefix)}


def count_blocks(keys: Iterable[str], stem: str) -> int:
    """Number of consecutive blocks stem.0., stem.1., ... present among the keys."""
    indices = set()
    for key in keys:
        if key.startswith(stem + "."):
            index = key[len(stem) + 1:].split(".", 1)[0]
            if index.isdigit():
                indices.add(int(index))
    count = 0
    while count in indices:
        count += 1
    return count


def folder_entries(header: Header, class_name: str, keys: Iterable[str], defaults: Optional[Mapping] = None,
                   tuples: Iterable[str] = ()) -> Optional[dict]:
    """What a diffusers folder's config.json says: None for a single file, {} for a folder of another class than
    `class_name`, else its entries named in `keys` over `defaults`, those named in `tuples` as tuples."""
    folder = header_config(header)
    if folder is None:
        return None
    if folder.get("_class_name") != class_name:
        return {}
    config = {**(defaults or {}), **{key: folder[key] for key in keys if key in folder}}
    return {key: tuple(value) if key in tuples else value for key, value in config.items()}


def find_layout(header: Header, original_anchors: Sequence[str], diffusers_anchors: Sequence[str]
                ) -> Optional[tuple[str, str, dict]]:
    """(layout, prefix, tensors without it) of the first key layout, "original" or "diffusers", whose anchors the
    header holds; None when it holds neither's."""
    for layout, anchors in (("original", original_anchors), ("diffusers", diffusers_anchors)):
        prefix = find_prefix(header.tensors, anchors)
        if prefix is not None:
            return layout, prefix, strip_prefix(header.tensors, prefix)
    return None


def two_layouts(header: Header, folder: Optional[dict], anchors: tuple[Sequence[str], Sequence[str]],
                architecture: Callable[[dict, str], Optional[dict]]) -> Optional[tuple[str, str, dict]]:
    """(layout, prefix, config) of a file of a family with an original and a diffusers key layout: a diffusers
    folder of its class (folder: folder_entries' answer) as ("diffusers", "", its entries), else the layout whose
    anchors (original, diffusers) the header holds, with architecture(tensors without prefix, layout); None for
    another family's file (or where architecture says None)."""
    if folder is not None:
        return ("diffusers", "", folder) if folder else None
    found = find_layout(header, *anchors)
    if found is None:
        return None
    layout, prefix, keys = found
    config = architecture(keys, layout)
    return None if config is None else (layout, prefix, config)


def layout_keys(table: Mapping[str, tuple[str, str]], layout: str) -> dict[str, str]:
    """fact -> its key in `layout` ("original" or "diffusers"), from a family's table of (original, diffusers) keys."""
    index = ("original", "diffusers").index(layout)
    return {fact: keys[index] for fact, keys in table.items()}


def shape_of(tensors: Mapping[str, tuple], key: str) -> tuple[int, ...]:
    """Shape of a header entry; a clear error when a key the architecture needs is missing."""
    if key not in tensors:
        raise ValueError(f"the checkpoint has no tensor {key!r}, which this architecture needs: the file is "
                         f"incomplete or not the model family it looks like")
    return tuple(tensors[key][1])


BITSANDBYTES_SUFFIXES = (".absmax", ".quant_map", ".quant_state.bitsandbytes__nf4")


def detected_checkpoint(path: str, header: Optional[Header], detection, detect: Callable, family: str, what: str):
    """(header, detection) of `path`, each read only when not given; a file of another family raises naming `what`."""
    header = header or read_checkpoint_header(path)
    detection = detection or detect(header)
    if detection is None or detection.family != family:
        raise ValueError(f"{path!r} is not a {what} checkpoint")
    return header, detection


def check_quantization(header: Header, prefix: str):
    """The file's sp_runtime.formats.Quantization (None: a plain float file); clear errors for quantized files we
    cannot load: bitsandbytes (nf4 / int8), or ComfyUI / GGUF quant types formats does not dequantize."""
    markers = sorted(k for k in strip_prefix(header.tensors, prefix) if k.endswith(BITSANDBYTES_SUFFIXES))
    if markers:
        raise ValueError(f"{header.path!r} is a bitsandbytes (nf4 / int8) checkpoint (it has {markers[:3]}...), "
                         f"which is not supported; use a bf16, fp16, fp8, ComfyUI scaled fp8 / mixed precision or "
                         f"GGUF file")
    from ..formats import quantization
    return quantization(header, prefix)


# ---------------------------------------------------------------------------------------------------------------
# Dtypes

@dataclass(frozen=True)
class WeightDtypes:
    """How weights are kept: `storage` for the large layers, `compute` for everything else and for the maths.

    storage != compute (fp8) means diffusers' layerwise casting: weights stay fp8 and each layer is cast to
    `compute` only while it runs; norms, embeddings and the final projection stay in `compute`.
    quant: the file's quantization (sp_runtime.formats.Quantization): its Linear weights stay quantized when
    keep_quantized, else every quantized tensor is dequantized at load into these dtypes.
    """

    storage: torch.dtype
    compute: torch.dtype
    quant: Optional[object] = None
    keep_quantized: bool = False

    @property
    def quantized(self) -> str:
        """The kind of quantized file whose weights stay quantized ("scaled_fp8", "comfy_quant", "gguf"), or ""."""
        return self.quant.kind if self.keep_quantized else ""

    @property
    def layerwise(self) -> bool:
        return self.storage != self.compute

    @property
    def storage_name(self) -> str:
        return self.quantized or dtype_name(self.storage)

    @property
    def compute_name(self) -> str:
        return dtype_name(self.compute)


def dominant_dtype(header: Header, prefix: str = "") -> torch.dtype:
    """The float dtype holding most parameters under `prefix` (the checkpoint's own precision)."""
    totals: dict[str, int] = {}
    for dtype, shape in strip_prefix(header.tensors, prefix).values():
        if dtype in SAFETENSORS_DTYPES and SAFETENSORS_DTYPES[dtype].is_floating_point:
            numel = 1
            for size in shape:
                numel *= size
            totals[dtype] = totals.get(dtype, 0) + numel
    if not totals:
        raise ValueError(f"{header.path!r} holds no floating-point weights under {prefix!r}")
    return SAFETENSORS_DTYPES[max(totals, key=totals.get)]


def choose_dtypes(requested: str, header: Optional[Header] = None, prefix: str = "") -> WeightDtypes:
    """Weight dtypes for a request: "default" keeps the file's own (fp8 files stay fp8 with bf16 compute; quantized
    files stay quantized with bf16 compute); an explicit dtype dequantizes quantized files once, at load."""
    from ..formats import quantization
    name = dtype_name(requested)
    quant = quantization(header, prefix) if header is not None else None
    if name == "default":
        if header is None:
            raise ValueError("dtype 'default' needs the checkpoint header to know the file's precision")
        if quant is not None:
            return WeightDtypes(QUANTIZED_COMPUTE_DTYPE, QUANTIZED_COMPUTE_DTYPE, quant, keep_quantized=True)
        dtype = dominant_dtype(header, prefix)
        dtype = torch.float32 if dtype == torch.float64 else dtype
    else:
        dtype = DTYPES[name]
    if dtype in FP8_DTYPES:
        return WeightDtypes(dtype, FP8_COMPUTE_DTYPE, quant)
    return WeightDtypes(dtype, dtype, quant)


def resolved_dtype_name(requested: str, header: Header, detection) -> str:
    """The dtype name a request means for this checkpoint (its Detection): "default" becomes the file's own precision
    (what choose_dtypes makes of it), so "default" and that dtype named explicitly are one model. A file without
    weights (the synthetic family's spec) keeps "default", and so does a quantized file: kept quantized is what
    "default" alone asks for (no explicit dtype means it)."""
    name = dtype_name(requested)
    floats = [dtype for dtype, _ in strip_prefix(header.tensors, detection.prefix).values()
              if dtype in SAFETENSORS_DTYPES]
    if name != "default" or not floats or detection.quant:
        return name
    dtypes = choose_dtypes(name, header, detection.prefix)
    return name if dtypes.quantized else dtypes.storage_name


# ---------------------------------------------------------------------------------------------------------------
# Model construction and loading

def build_empty_model(model_cls, config: Mapping, dtypes: WeightDtypes, change: Optional[Callable] = None):
    """A diffusers model with parameters on the meta device (buffers real), layerwise casting set up for fp8;
    change(model) edits its modules first (modules a family adds get the same casting).

    accelerate's init_empty_weights keeps buffers real: torch.device("meta") would break non-persistent buffers
    (e.g. rotary tables) that no checkpoint carries.
    """
    from accelerate import init_empty_weights
    with init_empty_weights():
        model = model_cls.from_config(dict(config))
        if change is not None:
            change(model)
    if dtypes.layerwise:
        # On the empty model this only re-tags meta parameters: the hooked layers now expect `storage` tensors.
        model.enable_layerwise_casting(storage_dtype=dtypes.storage, compute_dtype=dtypes.compute)
    return model


def target_dtypes(model: torch.nn.Module, dtypes: WeightDtypes) -> dict[str, Optional[torch.dtype]]:
    """Final dtype of every state-dict entry (None: keep the file's dtype, for integer buffers)."""
    targets = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if not tensor.is_floating_point():
            targets[name] = None
        elif dtypes.layerwise and tensor.dtype == dtypes.storage:
            targets[name] = dtypes.storage
        else:
            targets[name] = dtypes.compute
    return targets


def row_split(prefix: str, names: Sequence[str], kind: str, sizes: Sequence[int]
              ) -> list[tuple[str, Transform]]:
    """Plan targets for a fused tensor whose rows are the parameters `names` (sizes rows each), in order."""
    targets, start = [], 0
    for name, size in zip(names, sizes):
        targets.append((f"{prefix}{name}.{kind}", _rows(start, size)))
        start += size
    return targets


def _rows(start: int, length: int) -> Transform:
    return lambda tensor: tensor.narrow(0, start, length)


def swap_halves(tensor: torch.Tensor) -> torch.Tensor:
    """The two halves of a tensor's rows swapped: (shift, scale) modulation rows <-> diffusers' (scale, shift)."""
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first])


def identity_plan(keys: Iterable[str], config=None) -> dict[str, list[tuple[str, Transform]]]:
    """A plan for checkpoints whose keys already are the model's keys (diffusers layout); the original_plan of a
    family whose files all name weights as diffusers does."""
    return {key: [(key, None)] for key in keys}


def diffusers_names(detection, keys: Iterable[str]) -> None:
    """The weight_plan of a family whose files all name weights as diffusers does (ComfyUI's too, a prefix aside):
    every layout loads as it is."""
    return None


def original_layout_plan(original_plan: Callable) -> Callable:
    """A family's weight_plan(detection, keys): how a checkpoint's keys (prefix stripped) become parameters, for
    load_model and for LoRA's re-reading of base weights: original-layout files through original_plan(keys, config),
    diffusers layouts as they are (None)."""
    return lambda detection, keys: original_plan(keys, detection.config) if detection.layout == "original" else None


def load_weights(model: torch.nn.Module, source: CheckpointSource, *, device: torch.device | str,
                 dtypes: WeightDtypes, prefix: str = "", plan: Optional[KeyPlan] = None,
                 ignore: Iterable[str] = (), progress: Optional[ProgressFn] = None) -> torch.nn.Module:
    """Read every tensor of `source` once onto `device`, convert it through `plan`, cast it, and assign it.

    plan: source key (prefix stripped) -> [(model key, transform)]; None means keys are already the model's.
    ignore: source keys (prefix stripped) that carry no weights (e.g. ComfyUI marker tensors).
    Quantized files (dtypes.quant): with dtypes.keep_quantized, Linear weights stay quantized (QuantLinear
    layers); every other quantized tensor is dequantized and cast like a plain one.
    Missing model keys and unknown source keys raise ValueError naming them. Returns the model, in eval mode.
    """
    from .. import formats
    from ..sharding import ShardSink
    from .deferred import Source, deferrable

    device = torch.device(device)
    targets = target_dtypes(model, dtypes)
    sink = ShardSink.for_model(model, targets, device, plain=dtypes.quant is None)  # shard_weights: blocks go there
    defer = deferrable(model) if sink is None and dtypes.quant is None else set()  # TP: read once split
    deferred: dict[str, Source] = {}
    linear_weights = {f"{name}.weight" for name, module in model.named_modules()
                      if isinstance(module, torch.nn.Linear)} if dtypes.keep_quantized else set()
    ignore = set(ignore)
    state: dict[str, torch.Tensor] = {}
    quantized: dict[str, formats.QuantWeight] = {}
    unexpected: list[str] = []
    reporter = _Progress(progress, source)
    quant = dtypes.quant
    ignore |= quant.auxiliary if quant else {formats.comfy_quant.LEGACY_MARKER}  # a stray marker: ComfyUI ignores it
    for file in source.files:
        with formats.open_weights(file, device) as handle:
            for key in handle.keys():
                if not key.startswith(prefix):
                    continue
                name = key[len(prefix):]
                if name in ignore:
                    continue
                outputs = [(name, None)] if plan is None else plan.get(name)
                if outputs is None or any(target not in targets for target, _ in outputs):
                    unexpected.append(name)
                    continue
                if defer and all(target in defer for target, _ in outputs):
                    deferred.update({target: Source(file, key, transform, targets[target])
                                     for target, transform in outputs})
                    continue
                sliced = sink.read_slices(handle, key, outputs) if sink else None  # this rank's rows only
                if sliced is not None:
                    shape, dtype = sliced
                    reporter.advance(math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize)
                    continue
                weight = formats.read_quant(handle, key, name, quant)
                kept = weight is not None and all(target in linear_weights for target, _ in outputs)
                tensor = None if kept else handle.get_tensor(key) if weight is None else weight.dequantize()
                if tensor is not None and not tensor.is_floating_point():
                    _refuse_integer(file, key, tensor, [target for target, _ in outputs if targets[target]])
                for target, transform in outputs:
                    block = sink.block_of(target) if sink else None
                    if kept:
                        value = weight.map_rows(transform)
                    else:
                        value = cast_weight(transform(tensor) if transform else tensor, targets[target])
                    if block is not None:
                        sink.put(block, target, value)  # packed into this rank's shard: copied there
                    elif kept:
                        quantized[target] = value.owned()
                    else:
                        state[target] = out_of_file(value, tensor)
                reporter.advance(weight.nbytes if weight is not None else tensor.numel() * tensor.element_size())
                del tensor, weight
    _check_keys(source, targets, {*state, *quantized, *deferred, *(sink.names if sink else ())}, unexpected)
    formats.install_quant_linears(model, quantized, state)
    # sharded blocks: placeholders set already; deferred weights stay meta until read_deferred
    model.load_state_dict(state, strict=sink is None and not deferred, assign=True)
    if deferred:
        model.__dict__["_deferred_weights"] = deferred
    if sink is not None:
        sink.finish()
    move_buffers(model, device)
    model.requires_grad_(False)
    reporter.done()
    return model.eval()


def _refuse_integer(file: str, key: str, tensor: torch.Tensor, float_targets: list[str]) -> None:
    """An integer tensor where the model has a floating-point weight: a cast would load numbers that were never
    weights (quantized integer weights carry a quantization entry and are read as such)."""
    if float_targets:
        raise ValueError(f"{file!r}: tensor {key!r} holds integers ({tensor.dtype}) where the model has the "
                         f"floating-point weight {float_targets[0]!r}; it is not a plain checkpoint nor a "
                         f"quantized format ulysses-sp reads")


def _check_keys(source: CheckpointSource, targets: Mapping, loaded: set, unexpected: list[str]) -> None:
    missing = sorted(set(targets) - loaded)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} weights the model needs are missing (e.g. {missing[:4]})")
        if unexpected:
            parts.append(f"{len(unexpected)} tensors are not part of the model (e.g. {sorted(unexpected)[:4]})")
        raise ValueError(f"{source.path!r} does not match the detected architecture: {'; '.join(parts)}. "
                         f"The file may be a different variant or a merge with extra layers")


def move_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Buffers were built on the CPU by init_empty_weights; parameters already sit on `device`."""
    for module in model.modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)


class _Progress:
    """Reports loading progress by bytes read, at most once per percent."""

    def __init__(self, progress: Optional[ProgressFn], source: CheckpointSource):
        self.progress = progress
        self.total = max(1, sum(os.path.getsize(f) for f in source.files))
        self.read = 0
        self.last = -1.0
        self.name = os.path.basename(source.path)

    def advance(self, nbytes: int) -> None:
        self.read += nbytes
        fraction = min(1.0, self.read / self.total)
        if self.progress is not None and fraction - self.last >= 0.01:
            self.last = fraction
            self.progress(fraction, f"loading {self.name}")

    def done(self) -> None:
        if self.progress is not None:
            self.progress(1.0, f"loaded {self.name}")
