"""Tensor parallelism of a planned model: which Linear layers of each block are split across the TP ranks (a plan
as data, TensorParallelPlan) and the module surgery that splits them.

Megatron's split, as torchtitan's parallelize.py declares it: q / k / v and the first feed-forward projection are
column-parallel (each rank computes its slice of the output features: H/T heads), the attention output and the
second feed-forward projection row-parallel (each rank multiplies its slice of the input features, one all-reduce
sums the partial outputs, the bias is added once after it). The blocks' modulation Linears (adaLN: temb -> 6 x
width, a third of a Flux / Qwen-Image block's weights) are split by rows too and all-gathered (GATHER: a few
numbers per item, no tokens). Norms and embedders stay replicated.
Heads are split by TP first, balanced (5 heads at TP 2: 3 and 2; each feature axis in whole heads' widths), then
Ulysses / Ring split each rank's heads / tokens as usual (sp_attention takes any head count). Every family gets the
generic plan unless it declares its own (Plan.tensor_parallel), or a string saying why it refuses TP.

Why not torch.distributed.tensor.parallel (ColwiseParallel / RowwiseParallel): it turns parameters into DTensors,
which the rest of the runtime rewrites in place as plain tensors (LoRA merges from the base weights, quantized
QuantLinear buffers, shard_weights' flat block buffers, layerwise fp8 casting); the split itself is a slice of the
weight and one all_reduce, the same ops those classes run, so a few lines here give the same result with no DTensor
dispatch on every call.
Under compile=True (sp_runtime.compile) the all-reduces / all-gathers of the split layers stay inside the compiled
blocks: dynamo traces c10d's in-place collectives as functional collectives (_c10d_functional.all_reduce /
all_gather_into_tensor + wait_tensor) on the same process group, the same sum of the same partial outputs, so the
graphs equal eager TP (bitwise with aot_eager; inductor 4e-7 of the scale, its own fusion rounding) and no graph break
per row-parallel layer (torch.compiler.disable here would cost one per layer and keep inductor from fusing the bias
add after the sum).
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..attention import SeqShards
from ..formats import QuantLinear

COLUMN, ROW, GATHER, NORM, KEY_VALUE = "column", "row", "gather", "norm", "key_value"
PACKED = "packed"
QUERIES = ("to_q", "to_query", "q_proj", "processor.img_to_q")  # diffusers' (Kandinsky 5's), transformers', Boogu's
KEYS_VALUES = ("to_k", "to_v", "to_key", "to_value", "k_proj", "v_proj",
               *(f"processor.{stream}_to_{kind}" for stream in ("img", "instruct") for kind in "kv"))


@dataclass(frozen=True)
class Split:
    """A Linear of every block split across the TP ranks. name: its module path inside a block, or the end of it
    ("to_q" matches "attn.to_q"). kind: COLUMN (output features: rows of the weight, and the bias), ROW (input
    features: columns of the weight; the outputs are all-reduced) or GATHER (rows, the outputs all-gathered: the
    module's output stays whole). NORM: an RMSNorm over the whole q / k width after a column split (Wan's
    norms across heads): its weight sliced, the mean square all-reduced. parts: the split feature axis is made of these
    equal parts (a fused q / k / v: 3), or of the output widths of the named column-split Linears of the block (a
    row split whose input is their concatenation, Flux's single-block proj_out over [attention, MLP]); each part is
    shared out over the T ranks (balanced, in whole heads inside an attention module) and a rank takes its piece of
    each. A column split under a gated activation (diffusers' GEGLU,
    SwiGLU: [hidden, gate]) takes 2 parts by itself. parts=PACKED: the sizes diffusers stores on a fused Linear
    (`_tp_packed_col_blocks` / `_tp_packed_row_blocks`, e.g. Flux.2's to_qkv_mlp_proj: q, k, v, gate, value).
    KEY_VALUE: the key / value projection of a grouped-query attention: split in whole key / value heads where the
    degree divides both head counts, else kept whole on every rank (replicated, as vLLM does); the family's
    projection takes each query head's key / value head with grouped_key_values."""

    name: str
    kind: str
    parts: Union[int, str, tuple[str, ...]] = 1


ATTENTION_SPLITS = (Split("to_q", COLUMN), Split("to_k", COLUMN), Split("to_v", COLUMN),
                    Split("add_q_proj", COLUMN), Split("add_k_proj", COLUMN), Split("add_v_proj", COLUMN),
                    Split("to_qkv", COLUMN, 3), Split("to_added_qkv", COLUMN, 3),
                    Split("to_out.0", ROW), Split("to_add_out", ROW))
FEED_FORWARD_SPLITS = (Split("net.0.proj", COLUMN), Split("net.2", ROW))  # diffusers' FeedForward
MODULATION_SPLITS = tuple(Split(name, GATHER) for name in ("norm1.linear", "norm1_context.linear", "norm.linear",
                                                           "img_mod.1", "txt_mod.1"))


@dataclass(frozen=True)
class TensorParallelPlan:
    """What a family's blocks split (the generic declaration fits diffusers' attention modules and FeedForward;
    a family adds its own Linears in `extra`). Attention modules of the blocks (those with `heads`) get heads / T."""

    splits: tuple[Split, ...] = ATTENTION_SPLITS + FEED_FORWARD_SPLITS + MODULATION_SPLITS
    extra: tuple[Split, ...] = ()
    attentions: tuple[str, ...] = ()  # a custom block's attention modules (no processor): their `heads` split too

    def all_splits(self) -> tuple[Split, ...]:
        return self.extra + self.splits  # a family's own entry wins over a generic one for the same module


GENERIC = TensorParallelPlan()
# single-stream blocks (Flux.1, HunyuanVideo): proj_out reads [attention output, MLP] (their column splits side by side)
SINGLE_STREAM = TensorParallelPlan(extra=(Split("proj_mlp", COLUMN), Split("proj_out", ROW, ("attn.to_q", "proj_mlp"))))


@dataclass
class TPSlice:
    """The rows (dim 0) or columns (dim 1) of a full weight that this rank holds: `ranges` of the full axis."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    full_shape: tuple[int, ...] = field(default=())

    def take(self, full: torch.Tensor) -> torch.Tensor:
        dim = min(self.dim, full.dim() - 1)  # a bias is 1-D: its rows
        pieces = [full.narrow(dim, start, stop - start) for start, stop in self.ranges]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def parallelize(model: torch.nn.Module, block_lists: Sequence[str], plan: TensorParallelPlan, group,
                rank: int, degree: int) -> dict[str, TPSlice]:
    """Split the model's blocks (ModuleLists named in block_lists) in place for TP rank `rank` of `degree`;
    returns parameter name -> the slice of the full weight it now holds (for LoRAs, loading, accounting).
    Heads are shared out balanced (5 heads at TP 2: 3 and 2), the other feature axes likewise in whole heads' widths
    where they are multiples of it; ValueError naming the module and the numbers when a rank would get nothing."""
    slices: dict[str, TPSlice] = {}
    for list_name in block_lists:
        for index, block in enumerate(getattr(model, list_name, None) or ()):
            prefix = f"{list_name}.{index}"
            modules = dict(block.named_modules())
            found = _matches(modules, plan.all_splits())
            attentions = [path for path, module in modules.items()
                          if _is_split_attention(path, module, found, plan.attentions)]
            widths = _head_widths(modules, attentions, found, prefix, degree)  # drops key / values kept whole
            sizes = {path: _part_sizes(modules[path], split, path, modules, f"{prefix}.{path}", degree)
                     for path, split in found.items()}  # all widths before any module is cut
            for path, split in found.items():
                where = f"tensor_parallel_degree={degree} cannot split {prefix}.{path}"
                if split.kind == GATHER and any(size % degree for size in sizes[path]):
                    continue  # its output is gathered whole: an uneven split gains little, the layer stays whole
                names = split.parts if isinstance(split.parts, tuple) else (path,) * len(sizes[path])
                units = [1 if split.kind == GATHER else _unit(name, widths) for name in names]
                ranges = _ranges(sizes[path], units, rank, degree, where)
                cut = _split_norm if split.kind == NORM else _split_linear
                kind = COLUMN if split.kind == KEY_VALUE else split.kind
                for name, piece in cut(modules[path], kind, ranges, group, degree, where).items():
                    slices[f"{prefix}.{path}.{name}"] = piece
            for path in attentions:
                _split_heads(modules[path], f"{prefix}.{path}" if path else prefix, rank, degree)
    return slices


def _matches(modules: dict, splits: Sequence[Split]) -> dict[str, Split]:
    found: dict[str, Split] = {}
    for path, module in modules.items():
        if not isinstance(module, (torch.nn.Linear, torch.nn.RMSNorm, QuantLinear)):
            continue
        for split in splits:
            if path == split.name or path.endswith("." + split.name):
                found[path] = split
                break
    return found


def _head_widths(modules: dict, attentions: list[str], found: dict, where: str, degree: int) -> dict[str, int]:
    """The split attention modules of a block -> the features of one of their heads: the unit their projections'
    feature axes are shared out in, so a rank's q / k / v / output columns are whole heads."""
    widths = {}
    for path in attentions:
        attn, inside = modules[path], f"{path}." if path else ""
        heads = getattr(attn, _heads_attribute(attn))
        if heads < degree:
            raise ValueError(f"tensor_parallel_degree={degree} cannot split the {heads} attention heads of "
                             f"{where}{'.' + path if path else ''} over {degree} ranks: use a degree of at most "
                             f"{heads}")
        inner = getattr(attn, "inner_dim", None)
        query = next((modules[inside + name] for name in QUERIES if inside + name in modules), None)
        full = inner if isinstance(inner, int) else query.out_features if query is not None else attn.head_dim * heads
        widths[path] = width = full // heads
        grouped = {inside + name: modules[inside + name] for name in KEYS_VALUES if inside + name in found}
        if grouped:  # the whole model's key / value heads, for grouped_key_values (a split leaves a rank's share)
            attn.tp_kv_heads = max(proj.out_features for proj in grouped.values()) // width
        if query is not None and any(proj.out_features != query.out_features for proj in grouped.values()) and (
                heads % degree or any(proj.out_features // width % degree for proj in grouped.values())):
            if all(found[name].kind == KEY_VALUE for name in grouped):
                for name in grouped:  # kept whole: each rank's query heads read their own key / value heads
                    del found[name]
                continue
            kv_heads = max(proj.out_features for proj in grouped.values()) // width
            raise ValueError(f"tensor_parallel_degree={degree} does not divide the {heads} query and {kv_heads} "
                             f"key / value heads of {where}.{path} (grouped-query attention: a rank's query heads "
                             f"must share its key / value heads): use a degree that divides both")
    return widths


def grouped_key_values(attn, tensors: Sequence[torch.Tensor], heads: int, kv_heads: int) -> list[torch.Tensor]:
    """Key / value [B, S, h_kv, D] of a grouped-query attention (KEY_VALUE splits) for the query heads this rank holds
    (`heads` of them: all without TP): [B, S, heads, D], query head i of the whole model reading key / value head
    i // (its heads / kv_heads), as grouped attention does. kv_heads: the whole model's; the rank's query heads
    (attn.tp_heads, set by the split) and whether its key / value heads were split or kept whole (then it holds all
    kv_heads) say which of them it reads."""
    lo, hi, whole = getattr(attn, "tp_heads", (0, heads, heads))
    group = whole // kv_heads
    first = lo // group if tensors[0].shape[2] < kv_heads else 0  # split: this rank's key / value heads
    index = torch.arange(lo, hi, device=tensors[0].device) // group - first
    return [tensor.index_select(2, index) for tensor in tensors]


def _unit(path: str, widths: dict[str, int]) -> int:
    """The head width of the attention module holding `path` (its projections split in whole heads), else 1."""
    for attention, width in widths.items():
        if not attention or path.startswith(attention + "."):
            return width
    return 1


def _ranges(sizes: list[int], units: list[int], rank: int, degree: int, where: str) -> tuple[tuple[int, int], ...]:
    """This rank's ranges of the full feature axis made of parts of `sizes`: each part shared out balanced, in
    its unit (whole heads) where the part is a multiple of it, else in single features."""
    ranges, start = [], 0
    for size, unit in zip(sizes, units):
        step = unit if size % unit == 0 else 1
        if size // step < degree:
            raise ValueError(f"{where}: its {size} features cannot be shared out over {degree} ranks")
        lo, hi = SeqShards.balanced(size // step, degree).range(rank)
        ranges.append((start + lo * step, start + hi * step))
        start += size
    return tuple(ranges)


def _part_sizes(module, split: Split, path: str, modules: dict, where: str, degree: int) -> list[int]:
    if split.kind == NORM:
        if not isinstance(module, torch.nn.RMSNorm) or module.weight is None:
            raise ValueError(f"tensor parallelism: {where} is not an RMSNorm with a weight ({type(module).__name__})")
        return [module.normalized_shape[-1]]
    width = module.in_features if split.kind == ROW else module.out_features
    if split.parts == PACKED:
        attribute = "_tp_packed_row_blocks" if split.kind == ROW else "_tp_packed_col_blocks"
        sizes = list(getattr(module, attribute, None) or ())
        if sum(sizes) != width:
            raise ValueError(f"tensor parallelism: {where} carries no {attribute} matching its {width} features "
                             f"(this diffusers version does not declare its fused parts)")
        return sizes
    if isinstance(split.parts, tuple):
        sizes = [modules[name].out_features for name in split.parts]
        if sum(sizes) != width:
            raise ValueError(f"tensor parallelism: {where} has {width} input features, not the {sum(sizes)} of "
                             f"{', '.join(split.parts)}")
        return sizes
    parts = 2 if split.kind == COLUMN and _gated(modules, path) else split.parts
    if width % parts:
        raise ValueError(f"tensor parallelism: {where} has {width} features, not {parts} equal parts")
    return [width // parts] * parts


def _gated(modules: dict, path: str) -> bool:
    """The fused projection of a gated activation module (diffusers' GEGLU / SwiGLU .proj: [hidden, gate] halves)."""
    parent = modules.get(path.rsplit(".", 1)[0]) if path.endswith(".proj") else None
    return parent is not None and type(parent).__name__.endswith("GLU")


def _split_linear(module: torch.nn.Linear, kind: str, ranges: tuple, group, degree: int,
                  where: str = "") -> dict[str, TPSlice]:
    dim = 1 if kind == ROW else 0
    if isinstance(module, QuantLinear):
        return _split_quant_linear(module, kind, dim, ranges, group, degree, where)
    weight_slice = TPSlice(dim, tuple(ranges), tuple(module.weight.shape))
    taken = {"weight": weight_slice}
    module.weight = torch.nn.Parameter(weight_slice.take(module.weight.detach()).clone(), requires_grad=False)
    if kind == ROW:
        module.in_features = module.weight.shape[1]
    else:
        module.out_features = module.weight.shape[0]
        if module.bias is not None:
            bias_slice = TPSlice(0, tuple(ranges), tuple(module.bias.shape))
            module.bias = torch.nn.Parameter(bias_slice.take(module.bias.detach()).clone(), requires_grad=False)
            taken["bias"] = bias_slice
    if kind != COLUMN:
        module.__class__ = _parallel_class(RowParallelLinear if kind == ROW else GatheredLinear, type(module))
        module.tp_group, module.tp_degree = group, degree
        _rebind_hooked_forward(module)
    return taken


def _split_quant_linear(module: QuantLinear, kind: str, dim: int, ranges: tuple, group, degree: int, where: str
                        ) -> dict[str, TPSlice]:
    """A quantized Linear split as its format's structure allows (formats.tp_split); its buffers replaced."""
    from ..formats.tp_split import split_quant
    weight = module.quant
    if module.deltas:
        raise ValueError(f"{where}: a quantized layer carrying LoRA deltas cannot be split")
    part = split_quant(weight, dim, ranges, where)
    for name, tensor in {**part.rows, **part.consts}.items():
        module._buffers[f"quant_{name}"] = tensor
    module._layout = (part.format, part.shape, part.params, tuple(part.rows), tuple(part.consts))
    module.out_features, module.in_features = part.shape[0], part.shape[1]
    taken = {"weight": TPSlice(dim, ranges, tuple(weight.shape))}
    if kind != ROW and module.bias is not None:
        bias_slice = TPSlice(0, ranges, tuple(module.bias.shape))
        module.bias = torch.nn.Parameter(bias_slice.take(module.bias.detach()).clone(), requires_grad=False)
        taken["bias"] = bias_slice
    if kind != COLUMN:
        module.__class__ = _parallel_class(RowParallelQuantLinear if kind == ROW else GatheredQuantLinear,
                                           type(module))
        module.tp_group, module.tp_degree = group, degree
    return taken


def _rebind_hooked_forward(module) -> None:
    """diffusers' hooks (layerwise fp8 casting) replaced module.forward by a wrapper around the forward bound when
    they were registered (nn.Linear's): point the innermost one at the new class's forward."""
    registry = getattr(module, "_diffusers_hook", None)
    if registry is None or not getattr(registry, "_fn_refs", None):
        return
    inner = registry._fn_refs[0]
    if getattr(inner, "original_forward", None) is not None:
        raise ValueError(f"tensor parallelism cannot split a {type(module).__name__} whose forward a diffusers hook "
                         f"replaced")
    inner.forward = types.MethodType(type(module).forward, module)


_CLASSES: dict[tuple[type, type], type] = {}


def _parallel_class(parallel: type, cls: type) -> type:
    """cls with the parallel class's forward (the module keeps its parameters, hooks and state-dict names)."""
    if issubclass(cls, parallel):
        return cls
    if (parallel, cls) not in _CLASSES:
        _CLASSES[parallel, cls] = type(f"{parallel.__name__}{cls.__name__}", (parallel, cls), {})
    return _CLASSES[parallel, cls]


class RowParallelLinear(torch.nn.Linear):
    """A Linear holding columns of its weight: partial output, summed over the TP group, then the bias."""

    tp_group: Optional[dist.ProcessGroup] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        dist.all_reduce(out, group=self.tp_group)
        return out if self.bias is None else out + self.bias


def _split_norm(module: torch.nn.RMSNorm, kind: str, ranges: tuple, group, degree: int,
                where: str = "") -> dict[str, TPSlice]:
    full_width = module.normalized_shape[-1]
    weight_slice = TPSlice(0, ranges, tuple(module.weight.shape))
    module.weight = torch.nn.Parameter(weight_slice.take(module.weight.detach()).clone(), requires_grad=False)
    module.__class__ = _parallel_class(SplitRMSNorm, type(module))
    module.tp_group, module.full_width = group, full_width
    module.normalized_shape = (module.weight.shape[0],)
    return {"weight": weight_slice}


class SplitRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm over features split across the TP ranks: the mean square of the whole width (all-reduced
    sum of squares), this rank's slice of the weight."""

    tp_group: Optional[dist.ProcessGroup] = None
    full_width: int = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        squares = x.float().pow(2).sum(-1, keepdim=True)
        dist.all_reduce(squares, group=self.tp_group)
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        normed = (x.float() * torch.rsqrt(squares / self.full_width + eps)).to(x.dtype)
        return normed * self.weight


class GatheredLinear(torch.nn.Linear):
    """A Linear holding rows of its weight: its slice of the output, all-gathered into the whole output."""

    tp_group: Optional[dist.ProcessGroup] = None
    tp_degree: int = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias).contiguous()
        pieces = [torch.empty_like(out) for _ in range(self.tp_degree)]
        dist.all_gather(pieces, out, group=self.tp_group)
        return torch.cat(pieces, dim=-1)


class RowParallelQuantLinear(QuantLinear):
    """A QuantLinear holding whole input groups of its weight: the partial output (dequantized matmul: the
    low-precision kernels add the bias inside), summed over the TP group, then the bias."""

    tp_group: Optional[dist.ProcessGroup] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.quant.dequantize(x.dtype))
        for first, up, factor in self.deltas:  # a LoRA's share of the input columns (lora.apply._split_terms)
            out = out + factor * (F.linear(x, first.to(x.dtype)) if up is None else
                                  F.linear(F.linear(x, first.to(x.dtype)), up.to(x.dtype)))
        dist.all_reduce(out, group=self.tp_group)
        return out if self.bias is None else out + self.bias.to(x.dtype)


class GatheredQuantLinear(QuantLinear):
    """A QuantLinear holding rows of its weight: its slice of the output, all-gathered into the whole output."""

    tp_group: Optional[dist.ProcessGroup] = None
    tp_degree: int = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x).contiguous()
        pieces = [torch.empty_like(out) for _ in range(self.tp_degree)]
        dist.all_gather(pieces, out, group=self.tp_group)
        return torch.cat(pieces, dim=-1)


def _heads_attribute(module) -> Optional[str]:
    """Where an attention module keeps its head count (diffusers: `heads`; a few: `num_heads`)."""
    return next((name for name in ("heads", "num_heads") if isinstance(getattr(module, name, None), int)), None)


def _is_split_attention(path: str, module, found: dict, declared: Sequence[str] = ()) -> bool:
    named = any(path == name or path.endswith("." + name) for name in declared)
    if _heads_attribute(module) is None or not (named or hasattr(module, "set_processor")):
        return False
    inside = f"{path}." if path else ""
    return any(name.startswith(inside) and (name[len(inside):] in (*QUERIES, "to_qkv", "to_qkv_mlp_proj")
                                            or (found[name].kind == COLUMN and found[name].parts == 3))
               for name in found)  # a query projection, or a fused q / k / v of the family's own name


def _split_heads(attn, where: str, rank: int, degree: int) -> None:
    """This rank's share of the heads (balanced: the first heads % degree ranks hold one more), as _ranges shares
    out the q / k / v features."""
    attribute = _heads_attribute(attn)
    heads = getattr(attn, attribute)
    lo, hi = SeqShards.balanced(heads, degree).range(rank)
    setattr(attn, attribute, hi - lo)
    attn.tp_heads = (lo, hi, heads)  # this rank's query heads of the whole model's (grouped_key_values, LTX rotary)
    if isinstance(getattr(attn, "inner_dim", None), int):  # a fused projection's q / k / v widths (Flux.2)
        attn.inner_dim = attn.inner_dim // heads * (hi - lo)
