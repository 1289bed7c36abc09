"""Tensor parallelism of a planned model: which Linear layers of each block are split across the TP ranks (a plan
as data, TensorParallelPlan) and the module surgery that splits them.

Megatron's split, as torchtitan's parallelize.py declares it: q / k / v and the first feed-forward projection are
column-parallel (each rank computes its slice of the output features: H/T heads), the attention output and the
second feed-forward projection row-parallel (each rank multiplies its slice of the input features, one all-reduce
sums the partial outputs, the bias is added once after it). The blocks' modulation Linears (adaLN: temb -> 6 x
width, a third of a Flux / Qwen-Image block's weights) are split by rows too and all-gathered (GATHER: a few
numbers per item, no tokens). Norms and embedders stay replicated.
Heads are split by TP first; Ulysses / Ring then split each rank's H/T heads / tokens as usual (sp_attention takes
any head count).

Why not torch.distributed.tensor.parallel (ColwiseParallel / RowwiseParallel): it turns parameters into DTensors,
which the rest of the runtime rewrites in place as plain tensors (LoRA merges from the base weights, quantized
QuantLinear buffers, shard_weights' flat block buffers, layerwise fp8 casting); the split itself is a slice of the
weight and one all_reduce, the same ops those classes run, so a few lines here give the same result with no DTensor
dispatch on every call.
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..formats import QuantLinear

COLUMN, ROW, GATHER, NORM = "column", "row", "gather", "norm"
PACKED = "packed"


@dataclass(frozen=True)
class Split:
    """A Linear of every block split across the TP ranks. name: its module path inside a block, or the end of it
    ("to_q" matches "attn.to_q"). kind: COLUMN (output features: rows of the weight, and the bias), ROW (input
    features: columns of the weight; the outputs are all-reduced) or GATHER (rows, the outputs all-gathered: the
    module's output stays whole). NORM: an RMSNorm over the whole q / k width after a column split (Wan's
    norms across heads): its weight sliced, the mean square all-reduced. parts: the split feature axis is made of these
    equal parts (a fused q / k / v: 3), or of the output widths of the named column-split Linears of the block (a
    row split whose input is their concatenation, Flux's single-block proj_out over [attention, MLP]); each part is
    cut in T pieces and a rank takes its piece of each. A column split under a gated activation (diffusers' GEGLU,
    SwiGLU: [hidden, gate]) takes 2 parts by itself. parts=PACKED: the sizes diffusers stores on a fused Linear
    (`_tp_packed_col_blocks` / `_tp_packed_row_blocks`, e.g. Flux.2's to_qkv_mlp_proj: q, k, v, gate, value)."""

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
    ValueError naming the module and the numbers when a width or head count is not divisible by the degree."""
    slices: dict[str, TPSlice] = {}
    for list_name in block_lists:
        for index, block in enumerate(getattr(model, list_name, None) or ()):
            prefix = f"{list_name}.{index}"
            modules = dict(block.named_modules())
            found = _matches(modules, plan.all_splits())
            sizes = {path: _part_sizes(modules[path], split, path, modules, f"{prefix}.{path}", degree)
                     for path, split in found.items()}  # all widths before any module is cut
            for path, split in found.items():
                cut = _split_norm if split.kind == NORM else _split_linear
                where = f"tensor_parallel_degree={degree} cannot split {prefix}.{path}"
                for name, piece in cut(modules[path], split.kind, sizes[path], group, rank, degree, where).items():
                    slices[f"{prefix}.{path}.{name}"] = piece
            for path, module in modules.items():
                if _is_split_attention(path, module, found):
                    _split_heads(module, f"{prefix}.{path}" if path else prefix, degree)
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


def _part_sizes(module, split: Split, path: str, modules: dict, where: str, degree: int) -> list[int]:
    if split.kind == NORM:
        if not isinstance(module, torch.nn.RMSNorm) or module.weight is None:
            raise ValueError(f"tensor parallelism: {where} is not an RMSNorm with a weight ({type(module).__name__})")
        width = module.normalized_shape[-1]
    else:
        width = module.in_features if split.kind == ROW else module.out_features
    if split.parts == PACKED:
        attribute = "_tp_packed_row_blocks" if split.kind == ROW else "_tp_packed_col_blocks"
        sizes = list(getattr(module, attribute, None) or ())
        if sum(sizes) != width:
            raise ValueError(f"tensor parallelism: {where} carries no {attribute} matching its {width} features "
                             f"(this diffusers version does not declare its fused parts)")
    elif isinstance(split.parts, tuple):
        sizes = [modules[name].out_features for name in split.parts]
        if sum(sizes) != width:
            raise ValueError(f"tensor parallelism: {where} has {width} input features, not the {sum(sizes)} of "
                             f"{', '.join(split.parts)}")
    else:
        parts = 2 if split.kind == COLUMN and _gated(modules, path) else split.parts
        sizes = [width // parts] * parts
    for size in sizes:
        if size % degree:
            raise ValueError(f"tensor_parallel_degree={degree} does not divide the {size} "
                             f"{'input' if split.kind == ROW else 'output'} features of {where}: use a degree "
                             f"that divides {size}")
    return sizes


def _gated(modules: dict, path: str) -> bool:
    """A projection inside a gated activation module ([hidden, gate] halves)."""
    parent = modules.get(path.rsplit(".", 1)[0]) if "." in path else None
    return parent is not None and type(parent).__name__.endswith("GLU")


def _split_linear(module: torch.nn.Linear, kind: str, sizes: list[int], group, rank: int, degree: int,
                  where: str = "") -> dict[str, TPSlice]:
    ranges, start = [], 0
    for size in sizes:
        piece = size // degree
        ranges.append((start + rank * piece, start + (rank + 1) * piece))
        start += size
    dim = 1 if kind == ROW else 0
    if isinstance(module, QuantLinear):
        return _split_quant_linear(module, kind, dim, tuple(ranges), group, degree, where)
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


def _split_norm(module: torch.nn.RMSNorm, kind: str, sizes: list[int], group, rank: int, degree: int,
                where: str = "") -> dict[str, TPSlice]:
    piece = sizes[0] // degree
    weight_slice = TPSlice(0, ((rank * piece, (rank + 1) * piece),), tuple(module.weight.shape))
    module.weight = torch.nn.Parameter(weight_slice.take(module.weight.detach()).clone(), requires_grad=False)
    module.__class__ = _parallel_class(SplitRMSNorm, type(module))
    module.tp_group, module.full_width = group, sizes[0]
    module.normalized_shape = (piece,)
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


def _is_split_attention(path: str, module, found: dict) -> bool:
    heads = getattr(module, "heads", None)
    if not isinstance(heads, int) or not hasattr(module, "set_processor"):
        return False
    inside = f"{path}." if path else ""
    return any(name.startswith(inside) and name[len(inside):] in ("to_q", "to_qkv", "to_qkv_mlp_proj")
               for name in found)


def _split_heads(attn, where: str, degree: int) -> None:
    if attn.heads % degree:
        raise ValueError(f"tensor_parallel_degree={degree} does not divide the {attn.heads} attention heads of "
                         f"{where}: use a degree that divides {attn.heads}")
    attn.heads //= degree
    if isinstance(getattr(attn, "inner_dim", None), int):  # a fused projection's q / k / v widths (Flux.2)
        attn.inner_dim //= degree
