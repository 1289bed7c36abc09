"""The one sequence-parallel worker: runs any family's Plan (sp.plan) for ComfyUI's diffusion_model call.

check inputs -> layout (streams) -> balanced shards of the split streams -> embed this rank's tokens -> slice the
rotary -> conditioning -> every stage's blocks (cancellation checked before each block, the stage's attention
geometry current) -> head -> write this rank's output tokens into the output buffer. The pool wraps the worker for
weight sharding and runtime options (sharding/, model_options), which hook every block the same way.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..attention import SeqShards
from .plan import Part, Plan, Stream
from .control import control_residuals, leading_shards
from .cross import LocalCrossAttention
from .processor import Geometry, SPAttnProcessor, current_geometry
from .tensor_parallel import GENERIC, parallelize
from .tokens import rotary


@dataclass
class Shard:
    """A stream on this rank: its shards and this rank's tokens [lo, hi) (replicated: all of them)."""

    stream: Stream
    shards: Optional[SeqShards]
    lo: int
    hi: int
    rope: Optional[tuple[torch.Tensor, torch.Tensor]]

    def flags(self, test, device) -> torch.Tensor:
        """bool [hi - lo]: which of this rank's tokens belong to parts for which test(part) holds."""
        values, start = [], 0
        for part in self.stream.parts:
            end = start + part.count
            overlap = max(0, min(self.hi, end) - max(self.lo, start))
            values.append(torch.full((overlap,), bool(test(part)), dtype=torch.bool))
            start = end
        return torch.cat(values).to(device) if values else torch.zeros(0, dtype=torch.bool, device=device)


class Call:
    """One call on this rank: the inputs, the streams' shards and states (attributes named after the streams), and
    whatever the plan's condition() sets (time embeddings, ...)."""

    def __init__(self, worker: "PlanWorker", x, timestep, inputs: dict, ctx):
        self.worker, self.model, self.config = worker, worker.model, worker.model.config
        self.dtype, self.options = worker.dtypes.compute, worker.options
        self.x, self.timestep, self.inputs, self.ctx = x, timestep, inputs, ctx
        self.device, self.seq, self.batch = ctx.device, ctx.groups.seq, x.shape[0]
        self.shards: dict[str, Shard] = {}
        self.skip: frozenset[int] = frozenset()  # the current stage's blocks to leave out (input skip_blocks)
        self.given_shards: dict[str, Any] = {}  # stream name -> (total tokens) -> SeqShards instead of balanced

    def input(self, name: str, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """An input ("x" or a name in inputs) on the device, cached across calls while unchanged, in the compute
        dtype unless told."""
        return self.ctx.to_device(name, self.x if name == "x" else self.inputs[name], dtype or self.dtype)

    def sigma(self) -> torch.Tensor:
        """The timestep as float32 [B] (ComfyUI embeds it from float32 sigma)."""
        sigma = self.ctx.to_device("timestep", self.timestep.reshape(-1), torch.float32)
        return sigma.expand(self.batch) if sigma.numel() == 1 else sigma


class PlanWorker:
    """A loaded model in one worker whose forward() runs its family's Plan (the pool's WorkerModel)."""

    def __init__(self, model, info, plan: Plan, dtypes, options: Optional[dict] = None):
        self.model, self.info, self.plan, self.dtypes = model, info, plan, dtypes
        self.options = options or {}
        for stage in plan.stages:
            if stage.attention is None:  # a custom block attends itself
                continue
            processor, local = SPAttnProcessor(stage.attention), LocalCrossAttention()
            for name in (stage.blocks, *stage.also):
                for block in getattr(model, name, None) or ():
                    for path, module in block.named_modules():
                        if hasattr(module, "set_processor") and hasattr(module, "processor"):
                            module.set_processor(local if path in stage.local else processor)
        self.tp_slices: dict = {}  # parameter -> sp.tensor_parallel.TPSlice of its full weight (TP only)
        self.ropes: dict[str, tuple] = {}  # stream -> (its ids, rope arguments, rotary tables) of the last call

    def split_tensor_parallel(self, tp) -> None:
        """Split the blocks' Linears across the TP group (groups.TensorParallel) as the plan's tensor_parallel says;
        ValueError naming the family and its reason when its plan refuses TP (a string)."""
        plan = self.plan.tensor_parallel
        if isinstance(plan, str):
            raise ValueError(f"tensor_parallel_degree={tp.degree} is not supported for {self.info.family!r} models "
                             f"({plan}); use ulysses_degree / ring_degree / shard_weights for this model")
        custom = [stage.blocks for stage in self.plan.stages if stage.attention is None]
        if custom and plan is GENERIC:  # the generic plan cannot know what a custom block does with its heads
            raise ValueError(f"tensor_parallel_degree={tp.degree} is not supported for {self.info.family!r} models "
                             f"(custom blocks {', '.join(custom)}: their plan must declare a TP plan)")
        lists = [name for stage in self.plan.stages for name in (stage.blocks, *stage.also)]
        self.tp_slices = parallelize(self.model, lists, plan, tp.group, tp.rank, tp.degree)

    def forward(self, x: torch.Tensor, timestep: torch.Tensor, inputs: dict[str, Any], out: torch.Tensor,
                ctx) -> None:
        plan, call = self.plan, Call(self, x, timestep, inputs, ctx)
        names, tokens = plan.output, self.run(call)
        tp = getattr(ctx.groups, "tp", None)
        if tp is not None and tp.rank != 0:  # the TP ranks of a group hold the same tokens: one writes them
            return
        if isinstance(names, str):
            names, tokens = (names,), (tokens,)
        for name, stream_tokens in zip(names, tokens):
            shard = call.shards[name]
            if shard.shards is None and call.seq.rank != 0:  # a replicated stream: one rank writes it
                continue
            if plan.output_tokens is not None:
                stream_tokens = plan.output_tokens(call, stream_tokens)
            _write(out, stream_tokens, shard)

    def residuals(self, main: Call, hint: torch.Tensor, stream: str):
        """As a ControlNet (sp.control): its plan on main's x, timestep and text, its `stream` sharded as the
        leading tokens of main's stream of that name (each rank its own tokens); returns what its head returns."""
        call = Call(self, main.x, main.timestep, {"context": main.inputs.get("context"), "hint": hint}, main.ctx)
        shards = main.shards[stream].shards
        call.given_shards[stream] = lambda total: leading_shards(shards, total)
        return self.run(call)

    def run(self, call: Call):
        """The plan on one call, up to its head (this rank's output tokens, or what a ControlNet's head returns)."""
        plan, ctx, inputs = self.plan, call.ctx, call.inputs
        plan.check(call)
        rope = None if plan.rope is None else plan.rope(call.config)
        for stream in plan.layout(call):
            given = call.given_shards.get(stream.name)
            call.shards[stream.name] = shard = _shard(stream, call.seq, rope, call.device, self.ropes,
                                                      None if given is None else given(stream.total))
            setattr(call, stream.name, _embed(self.model, stream, shard.lo, shard.hi, call.batch))
        plan.condition(call)
        controls = control_residuals(call, plan, self.info.family)
        skips = block_skips(plan, inputs.get("skip_blocks"), self.info.family)
        for stage in plan.stages:
            if stage.before is not None:
                stage.before(call)
            call.skip = skips.get(stage.blocks, frozenset())
            add = controls.adder(call, stage.blocks) if controls is not None else None
            geometry = nullcontext() if stage.attention is None else current_geometry(_geometry(call, stage))
            with geometry:
                for index, block in enumerate(getattr(self.model, stage.blocks)):
                    ctx.check_cancel()
                    if index not in call.skip or stage.skips_in_run:
                        stage.run(block, call)
                    if add is not None:
                        add(index)
            call.skip = frozenset()
        return plan.head(call)


def block_skips(plan: Plan, given, family: str) -> dict[str, frozenset[int]]:
    """Input skip_blocks ({ComfyUI block kind: [indices]}, SkipLayerGuidanceDiT's skipped blocks for this call) ->
    {stage blocks: indices}, through the plan's comfy_blocks."""
    if not given:
        return {}
    if plan.comfy_blocks is None:
        raise ValueError(f"skipping blocks (skip_blocks, e.g. SkipLayerGuidanceDiT) is not supported for {family} "
                         f"models under sequence parallelism yet; remove the node")
    if not isinstance(given, dict) or not all(isinstance(indices, (list, tuple)) and
                                              all(isinstance(i, int) and not isinstance(i, bool) for i in indices)
                                              for indices in given.values()):
        raise ValueError(f"skip_blocks must map a block kind to a list of block indices, got {given!r}")
    skips: dict[str, frozenset[int]] = {}
    for kind, indices in given.items():
        stage = plan.comfy_blocks.get(kind)
        if stage is not None:
            skips[stage] = skips.get(stage, frozenset()) | frozenset(indices)
    return skips


def _shard(stream: Stream, seq, rope, device, ropes: dict, given: Optional[SeqShards] = None) -> Shard:
    if stream.split:
        shards = given or SeqShards.balanced(stream.total, seq.degree)
        lo, hi = shards.range(seq.rank)
    else:
        shards, lo, hi = None, 0, stream.total
    ids = [part.ids for part in stream.parts if part.ids is not None]
    if rope is None or not ids:
        return Shard(stream, shards, lo, hi, None)
    return Shard(stream, shards, lo, hi, _rotary(ropes, stream.name, torch.cat(ids)[lo:hi], rope, device))


def _rotary(ropes: dict, name: str, ids: torch.Tensor, rope, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The stream's rotary tables, reused from the last call when its ids are the same (every denoising step of a
    generation): their float64 angles take 25 ms per call for 6889 tokens on one CPU core."""
    last = ropes.get(name)
    if last is not None and last[1] == rope and last[0].shape == ids.shape and last[0].device == ids.device \
            and torch.equal(last[0], ids) and last[2][0].device == torch.device(device):
        return last[2]
    tables = rotary(ids.to(device), *rope)
    ropes[name] = (ids, rope, tables)
    return tables


def _embed(model, stream: Stream, lo: int, hi: int, batch: int) -> torch.Tensor:
    """States [B, hi - lo, width] of the stream's tokens [lo, hi): only those are embedded, consecutive parts with
    the same embedder in one call."""
    runs: list[tuple[Any, list[torch.Tensor]]] = []
    start = 0
    for part in stream.parts:
        end = start + part.count
        if end > lo and start < hi:
            raw = part.tokens[:, max(lo, start) - start:min(hi, end) - start]
            raw = raw.expand(batch, *raw.shape[1:]) if raw.shape[0] == 1 else raw
            if runs and runs[-1][0] == part.embed:
                runs[-1][1].append(raw)
            else:
                runs.append((part.embed, [raw]))
        start = end
    if not runs:  # more ranks than tokens: this rank holds none (embedded to get the width and dtype)
        part = stream.parts[0]
        runs = [(part.embed, [part.tokens[:, :0].expand(batch, 0, part.tokens.shape[-1])])]
    states = [_embedder(model, embed)(torch.cat(raws, dim=1) if len(raws) > 1 else raws[0]) for embed, raws in runs]
    return torch.cat(states, dim=1) if len(states) > 1 else states[0]


def _embedder(model, embed):
    if isinstance(embed, str):
        return model.get_submodule(embed)
    return lambda raw: embed(model, raw)


def _geometry(call: Call, stage) -> Geometry:
    names = (stage.attends,) if isinstance(stage.attends, str) else stage.attends
    parts = [call.shards[name] for name in names]
    if len(parts) == 1:
        shards, mask = parts[0].shards, parts[0].stream.mask
    else:
        shards, mask = SeqShards.union(*(part.shards for part in parts)), None
    ropes = [part.rope for part in parts if part.rope is not None]
    if len(ropes) > 1:  # a union of streams: their tables in the same order (one stream: its own, not copied)
        ropes = [tuple(torch.cat(pieces) for pieces in zip(*ropes))]
    rope = ropes[0] if ropes else None
    geometry = Geometry(call.seq, shards, rope, mask=mask)
    if stage.text is not None:
        text = call.shards[stage.text]
        geometry.text_rope, geometry.text_mask = text.rope, text.stream.key_mask
        geometry.text_len = text.hi
    return geometry


def _write(out: torch.Tensor, tokens: torch.Tensor, shard: Shard) -> None:
    """Unpatchify this rank's tokens of the output parts (tokens [B, hi - lo, features]) into out."""
    start = 0
    for part in shard.stream.parts:
        end = start + part.count
        first, stop = max(shard.lo, start), min(shard.hi, end)
        if part.output is not None and stop > first:
            frame = part.output.frame
            target = out[:, :, frame] if out.dim() == 5 and frame is not None else out
            piece = tokens[:, first - shard.lo:stop - shard.lo].to(out.dtype).cpu()
            part.output.grid.write(target, piece, first - start)
        start = end
