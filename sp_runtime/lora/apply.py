"""The LoRAs applied to one loaded model in one worker.

Every patched parameter holds store_as(base + sum over the list, in order, of strength x scale x delta), computed in
float32 (ComfyUI's intermediate dtype) from the base value re-read from the checkpoint. A record per parameter of
which (file, strength) pairs it holds makes a change of list touch only the parameters whose contributions change;
the same list again touches nothing, and a parameter whose contributions become empty gets its base value back,
bitwise. All files are parsed, all names resolved and all shapes checked before the first parameter changes, and a
failure while writing (a cancel, an error) rewrites what was written back to the previous list: a set either
happens whole or leaves the weights as they were. Quantized layers (sp_runtime.formats.QuantLinear) are never rewritten: their LoRAs are kept
as unmerged low-rank (or difference) terms added at compute time, so removing them is exact too.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ..checkpoints.header import Header
from ..contract import Detection
from ..formats import QuantLinear
from ..sharding import model_shards
from .base import BaseWeights
from .files import Adapter, LoraFile, adapter_delta, adapter_factors, file_identity, read_lora_file
from .keys import KeyResolver, Target, family_plans
from .patch_math import is_additive, low_rank, patched_weight
from .patch_set import PatchSet
from .patch_targets import assemble, resolve_patch_targets, row_sources, split
from .rounding import store_as

Progress = Optional[Callable[[float, str], None]]
log = logging.getLogger("ulysses_sp.lora")
Contribution = tuple  # (file identity, strength): what a parameter's value depends on, per list entry


@dataclass(frozen=True)
class _Use:
    """One adapter of one list entry acting on one parameter."""

    entry: int
    adapter: Adapter
    target: Target


class LoraState:
    """LoRA bookkeeping for one loaded model (a diffusers module) in one worker."""

    def __init__(self, model: torch.nn.Module, family: str, checkpoint: "str | Header", device: torch.device,
                 detection: Optional[Detection] = None, tp_slices: Optional[dict] = None):
        self.model = model
        # tensor parallelism: parameter -> the slice of its full weight this rank holds; a LoRA is applied to the
        # full base weight (read from the file) and the rank keeps its slice of the result: exact, as unsplit
        self.tp_slices = tp_slices or {}
        self.family = family
        self.checkpoint = checkpoint
        self.detection = detection  # the load request's (None: detected from the checkpoint)
        self.device = torch.device(device)
        self.plan, self.weight_plan = family_plans(family, model)
        self.quantized = {f"{name}.weight": module for name, module in model.named_modules()
                          if isinstance(module, QuantLinear)}
        self.applied: dict[str, tuple[Contribution, ...]] = {}  # parameter -> contributions it holds now
        self._files: dict[str, LoraFile] = {}
        self._base: Optional[BaseWeights] = None
        self._resolver: Optional[KeyResolver] = None
        self._current: tuple = ([], None)  # the (loras, patches) the weights hold after the last successful set
        self._writes = 0  # write phases started (a failure after one restores)

    def set(self, loras: Sequence[Sequence], progress: Progress = None, patches: Optional[PatchSet] = None) -> dict:
        """Make the weights base + the given LoRAs ([[path, strength], ...], in order), then ComfyUI's weight
        `patches` (stock LoRA nodes) on top; returns a summary. On any failure the weights stay as they were."""
        writes = self._writes
        try:
            summary = self._set(loras, progress, patches)
        except BaseException:
            if self._writes != writes:
                self._restore()
            raise
        self._current = ([list(lora) for lora in loras], patches)
        return summary

    def _restore(self) -> None:
        """Rewrite the parameters a failed set changed to what the last successful set made them (each parameter's
        record says what it holds, so only those are rewritten)."""
        loras, patches = self._current
        try:
            self._set(loras, None, patches)
        except Exception:  # noqa: BLE001 - the records still say what each parameter holds: the next set fixes it
            log.exception("restoring the weights after a failed LoRA change failed")

    def _set(self, loras: Sequence[Sequence], progress: Progress, patches: Optional[PatchSet]) -> dict:
        parameters = self._targets()
        files = [self._file(path) for path, _ in loras]
        strengths = [float(strength) for _, strength in loras]
        uses = self._uses(files, strengths, parameters, progress)
        self.resolver.reset_budget()  # ComfyUI's weight patches: a budget of their own for decoding names
        groups = resolve_patch_targets(patches, self.resolver, parameters) if patches else {}
        wanted = {name: tuple((files[use.entry].identity, strengths[use.entry]) for use in group)
                  for name, group in uses.items()}
        for key, targets in groups.items():
            for target in targets:
                wanted[target.parameter] = wanted.get(target.parameter, ()) + ((patches.digest, key),)
        changed = {name for name in set(wanted) | set(self.applied)
                   if wanted.get(name, ()) != self.applied.get(name, ())}
        for targets in groups.values():  # a patched weight is rewritten whole: its patches may need every row
            if any(target.parameter in changed for target in targets):
                changed.update(target.parameter for target in targets)
        changed = sorted(changed, key=self.base.order)
        self._write(_Change(changed, uses, wanted, files, strengths, parameters, groups, patches), progress)
        skipped = sorted({module for lora in files for module in lora.skipped})  # the host logs them
        return {"parameters": len(wanted), "updated": len(changed), "skipped": skipped}

    # ---- preparation: nothing changes until every file and name is known good -----------------------------------
    def _targets(self) -> dict[str, torch.Tensor]:
        """What a LoRA may change: the parameters, and quantized weights (as meta tensors of their shape)."""
        targets = dict(self.model.named_parameters())
        shards = model_shards(self.model)  # sharded blocks hold placeholders: their real shapes
        targets.update({name: meta for name, meta in (shards.meta_tensors() if shards else {}).items()
                        if name in targets})
        targets.update({name: torch.empty(piece.full_shape, dtype=targets[name].dtype, device="meta")
                        for name, piece in self.tp_slices.items() if name in targets})
        targets.update({name: torch.empty(self.tp_slices[name].full_shape if name in self.tp_slices else
                                          (module.out_features, module.in_features), device="meta")
                        for name, module in self.quantized.items()})  # a split layer: the whole weight's shape
        return targets

    @property
    def base(self) -> BaseWeights:
        if self._base is None:
            self._base = BaseWeights(self.checkpoint, {name for name, _ in self.model.named_parameters()},
                                     self.weight_plan, self.detection)
        return self._base

    @property
    def resolver(self) -> KeyResolver:
        if self._resolver is None:
            names = list(self._targets())
            self._resolver = KeyResolver(names, self.plan, self.base.checkpoint_keys)
        return self._resolver

    def _file(self, path: str) -> LoraFile:
        cached = self._files.get(path)
        if cached is None or cached.identity != file_identity(path):
            self._files[path] = cached = read_lora_file(path)
        return cached

    def _uses(self, files: list[LoraFile], strengths: list[float], parameters: dict,
              progress: Progress = None) -> dict[str, list[_Use]]:
        """parameter -> the adapters acting on it, in list order (entries of strength 0 act on nothing)."""
        uses: dict[str, list[_Use]] = {}
        for entry, (lora, strength) in enumerate(zip(files, strengths)):
            unknown = []
            self.resolver.reset_budget()
            for adapter in lora.adapters:
                if progress is not None:  # where a cancel is seen while names are resolved
                    progress(0.0, "resolving LoRA names")
                try:
                    targets = self.resolver.resolve(adapter.module, adapter.kind)
                except ValueError as error:
                    raise ValueError(f"LoRA {lora.path!r}: {error}") from None
                if targets is None:
                    unknown.append(adapter.module)
                    continue
                for target in targets:
                    _check_shape(lora, adapter, target, parameters[target.parameter])
                    if strength != 0.0:
                        uses.setdefault(target.parameter, []).append(_Use(entry, adapter, target))
            if unknown:
                raise ValueError(
                    f"LoRA {lora.path!r}: {len(unknown)} of {len(lora.adapters)} modules match no weight of this "
                    f"{self.family} model (e.g. {sorted(unknown)[:4]}). It may be a LoRA for another model family "
                    f"or size. Names understood: the model's diffusers names or ComfyUI's names for it, bare or "
                    f"after 'transformer.' / 'diffusion_model.', and kohya 'lora_unet_...' / 'lora_transformer_...'")
        for group in uses.values():
            group.sort(key=lambda use: use.entry)
        return uses

    # ---- writing ------------------------------------------------------------------------------------------------
    def _write(self, change: "_Change", progress: Progress) -> None:
        from safetensors import safe_open

        self._writes += 1  # from here on a failure may leave parameters changed: set() restores them
        grouped = {target.parameter for targets in change.groups.values() for target in targets}
        deltas = _DeltaCache(change.uses, [name for name in change.names if name not in self.quantized])
        done = iter(range(len(change.names)))
        store = _Store(change.parameters, model_shards(self.model), self.tp_slices, self.model)
        with contextlib.ExitStack() as stack, self.base.reader(self.device) as read_base, torch.no_grad():
            handles = {}

            def handle(path: str):
                if path not in handles:
                    handles[path] = stack.enter_context(safe_open(path, framework="pt", device=str(self.device)))
                return handles[path]

            def file_deltas(name: str) -> list:
                terms = [_unmerged(use, change.strengths[use.entry], handle(change.files[use.entry].path))
                         for use in change.uses.get(name, ())]
                return _split_terms(terms, self.tp_slices.get(name))

            def value(name: str) -> torch.Tensor:
                """base + the LoRA files, float32"""
                parameter = change.parameters[name]
                result = read_base(name, parameter.dtype).to(torch.float32, copy=True)  # never the read tensor
                for use in change.uses.get(name, ()):
                    delta = deltas.get(use, handle(change.files[use.entry].path))
                    result += (change.strengths[use.entry] * use.adapter.scale) * delta.reshape(result.shape)
                return result

            for name in change.names:
                if name in grouped:
                    continue
                if name in self.quantized:
                    self.quantized[name].deltas = file_deltas(name)
                else:
                    store(name, value(name))
                self._record(name, change.wanted, progress, next(done), len(change.names))
            members = set(change.names)
            for key, targets in change.groups.items():
                if targets[0].parameter in members:  # a group changes whole
                    self._write_patched(key, targets, change, value, file_deltas, store)
                    for target in targets:
                        self._record(target.parameter, change.wanted, progress, next(done), len(change.names))

    def _write_patched(self, key: str, targets: list, change: "_Change", value, file_deltas, store) -> None:
        """One checkpoint weight under ComfyUI patches: put together from its parameters (each base + LoRA files),
        patched, split back; quantized parameters get the change as unmerged terms."""
        target = change.patches.targets[key]
        sources = row_sources(target.shape, targets, self.device)
        names = [found.parameter for found in targets]
        quantized = {name: file_deltas(name) for name in names if name in self.quantized}
        additive = all(is_additive(patch) for patch in target.patches)
        split_layers = [name for name in quantized if name in self.tp_slices]
        if split_layers and not (additive and len(quantized) == len(names)):
            # a rank holds its slice of the quantized weight only: a patch that needs the whole weight (DoRA, OFT,
            # strength_model, ...) cannot be applied to it; additive ones are terms the rank keeps its share of
            kinds = sorted({patch.kind for patch in target.patches if not is_additive(patch)})
            what = f"({', '.join(kinds)}) " if kinds else "(on quantized and float parameters at once) "
            raise ValueError(f"ComfyUI weight patches {what}on the split quantized layer {split_layers[0]} at "
                             f"tensor parallelism are not supported (only additive ones: lora, loha, lokr, diff "
                             f"without DoRA, strength_model 1); load a float file, or use ulysses_degree")
        if quantized and additive:  # unmerged terms of the whole weight; a split layer keeps its rows / columns
            for name, terms in _additive_terms(key, target, targets, sources, change.parameters).items():
                if name in quantized:
                    self.quantized[name].deltas = quantized[name] + _split_terms(terms, self.tp_slices.get(name))
            names = [name for name in names if name not in quantized]
            if not names:
                return
        values = {name: _merged(self.quantized[name], quantized[name]) if name in quantized else value(name)
                  for name in (found.parameter for found in targets)}
        weight = assemble(target.shape, targets, values, sources)
        patched = split(patched_weight(weight, target.patches, key), targets, sources, change.parameters)
        for name in names:
            if name in quantized:
                self.quantized[name].deltas = quantized[name] + [(patched[name] - values[name], None, 1.0)]
            else:
                store(name, patched[name])

    def _record(self, name: str, wanted: dict, progress: Progress, done: int, total: int) -> None:
        if wanted.get(name):
            self.applied[name] = wanted[name]
        else:
            self.applied.pop(name, None)
        if progress is not None:
            progress((done + 1) / total, "applying LoRA")


def _split_terms(terms: list, piece) -> list:
    """QuantLinear.deltas terms cut to a tensor-parallel split layer's share (sp.tensor_parallel.TPSlice of its
    weight): its rows of each up factor (column-parallel) or its columns of each down factor (row-parallel; the
    partial outputs are summed with the base's), the same rows / columns of a full difference."""
    if piece is None:
        return terms
    return [(piece.take(first), None, factor) if up is None else
            (first, piece.take(up), factor) if piece.dim == 0 else (piece.take(first), up, factor)
            for first, up, factor in terms]


def _unmerged(use: _Use, strength: float, handle) -> tuple:
    """(first, up, factor) for QuantLinear.deltas: the adapter's factors with the key plan's row transform applied
    to the output side (up, or the whole difference)."""
    first, up = adapter_factors(handle, use.adapter)
    transform = use.target.transform or (lambda tensor: tensor)
    factor = strength * use.adapter.scale
    # Copies: float32 factors of a float32 file are views of its memory map, which a rewrite of the file in place
    # would pull from under the kept terms (SIGBUS at the next call).
    if up is None:
        return transform(first).clone(), None, factor
    return first.clone(), transform(up).clone(), factor


@dataclass
class _Change:
    """What one `set` rewrites: the changed parameters in write order and everything their values come from."""

    names: list[str]
    uses: dict
    wanted: dict
    files: list[LoraFile]
    strengths: list[float]
    parameters: dict[str, torch.Tensor]
    groups: dict[str, list[Target]]
    patches: Optional[PatchSet]


def _merged(module: QuantLinear, deltas: list) -> torch.Tensor:
    """A quantized weight as it acts: dequantized (float32) plus its unmerged LoRA terms."""
    weight = module.quant.dequantize(torch.float32)
    for first, up, factor in deltas:
        weight += factor * (first if up is None else up @ first)
    return weight


def _additive_terms(key: str, target, targets: list[Target], sources: list, parameters: dict) -> dict[str, list]:
    """QuantLinear.deltas terms of additive patches per parameter: low-rank pairs for plain LoRAs (their up rows
    placed at the patch's offset), else the summed difference."""
    pairs = [low_rank(patch) for patch in target.patches]
    if all(pair is not None for pair in pairs) and all(p.offset is None or p.offset[0] == 0 for p in target.patches):
        terms: dict[str, list] = {found.parameter: [] for found in targets}
        for patch, (down, up, factor) in zip(target.patches, pairs):
            rows = torch.zeros(target.shape[0], up.shape[1], device=up.device)
            start, length = (patch.offset[1], patch.offset[2]) if patch.offset else (0, target.shape[0])
            rows.narrow(0, start, length).copy_(up)
            for found, source in zip(targets, sources):
                terms[found.parameter].append((down, rows[source.to(rows.device)], factor))
        return terms
    total = patched_weight(torch.zeros(target.shape, device=sources[0].device), target.patches, key)
    return {name: [(delta.reshape(parameters[name].shape[0], -1), None, 1.0)]
            for name, delta in split(total, targets, sources, parameters).items()}


class _Store:
    """Writes a LoRA-patched weight: into the parameter, for a sharded block (sharding) only this rank's bytes, for
    a tensor-parallel split its slice."""

    def __init__(self, parameters: dict, shards, tp_slices: Optional[dict] = None, model=None):
        self.parameters, self.shards, self.tp_slices = parameters, shards, tp_slices or {}
        self.model = model

    def __call__(self, name: str, value: torch.Tensor) -> None:
        parameter = self.parameters[name]
        stored = store_as(value, parameter.dtype, name)
        located = self.shards.locate(name) if self.shards else None
        if name in self.tp_slices:
            self.model.get_parameter(name).copy_(self.tp_slices[name].take(stored))
        elif located:
            located[0].write(located[1], stored)
        else:
            parameter.copy_(stored)


class _DeltaCache:
    """Adapter deltas (mapped onto their parameter) while some changed parameter still needs them; a fused qkv
    delta is computed once for its three parameters, which the sort order puts next to each other."""

    def __init__(self, uses: dict[str, list[_Use]], changed: list[str]):
        self.remaining: dict[tuple, int] = {}
        for name in changed:
            for use in uses.get(name, ()):
                key = (use.entry, use.adapter.module, use.adapter.kind)
                self.remaining[key] = self.remaining.get(key, 0) + 1
        self.source: dict[tuple, torch.Tensor] = {}

    def get(self, use: _Use, handle) -> torch.Tensor:
        key = (use.entry, use.adapter.module, use.adapter.kind)
        if key not in self.source:
            self.source[key] = adapter_delta(handle, use.adapter)
        delta = self.source[key]
        self.remaining[key] -= 1
        if not self.remaining[key]:
            del self.source[key]
        return use.target.transform(delta) if use.target.transform else delta


def _check_shape(lora: LoraFile, adapter: Adapter, target: Target, parameter: torch.Tensor) -> None:
    """The delta, mapped like a weight, must have the parameter's size (checked on a meta tensor: no reading)."""
    mapped = torch.empty(adapter.shape, device="meta")
    mapped = target.transform(mapped) if target.transform else mapped
    if mapped.numel() != parameter.numel() or (adapter.down is not None and mapped.shape[0] != parameter.shape[0]):
        raise ValueError(f"LoRA {lora.path!r}: module {adapter.module!r} gives a {list(mapped.shape)} change for "
                         f"{target.parameter} of shape {list(parameter.shape)}: a LoRA for another size of model")


def lora_state(worker_model, checkpoint: "str | Header", device: torch.device,
               detection: Optional[Detection] = None) -> LoraState:
    """A LoraState for a family's loaded WorkerModel (its diffusers module is `worker_model.model`)."""
    module = getattr(worker_model, "model", None)
    family = worker_model.info.family
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"LoRA is not supported for {family!r} models (supported: Qwen-Image, Flux, Wan)")
    return LoraState(module, family, checkpoint, device, detection, getattr(worker_model, "tp_slices", None))
