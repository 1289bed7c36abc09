"""A quantized weight as the workers keep it (QuantWeight) and the Linear layer that computes with it (QuantLinear).

Every format is held as row-indexed parts (tensors whose dim 0 is the weight's output rows: codes, per-row or
per-block scales) plus per-tensor constants, so the loaders' key-plan transforms (row slices of a fused qkv,
swapped halves) apply to a quantized weight part by part without dequantizing it. Dequantization happens per layer,
per call, into the activations' dtype.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch
import torch.nn.functional as F

# format name -> dequantizer(weight, dtype) -> tensor of weight.shape; each format module registers its own
DEQUANTIZERS: dict[str, Callable[["QuantWeight", torch.dtype], torch.Tensor]] = {}
_keep: list[Callable[[torch.Tensor], torch.Tensor]] = [torch.Tensor.clone]  # the innermost copies_into() wins


@contextlib.contextmanager
def copies_into(keep: Callable[[torch.Tensor], torch.Tensor]):
    """While loading: how kept CPU weights are copied (the pool's CPU workers: into memory the ranks share)."""
    _keep.append(keep)
    try:
        yield
    finally:
        _keep.remove(keep)


def sharing_weights() -> bool:
    """Whether kept weights go to shared memory now (then even private tensors move there)."""
    return _keep[-1] is not torch.Tensor.clone


def kept_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU weight the model keeps, as its own copy (never a view of a file mapping: a checkpoint rewritten on
    disk must not change a loaded model, nor kill its worker with SIGBUS)."""
    return _keep[-1](tensor)


@dataclass
class QuantWeight:
    """One quantized weight: `rows` parts share dim 0 with the weight; `consts` are per-tensor values."""

    format: str                       # a DEQUANTIZERS key, e.g. "scaled", "mxfp8", "nvfp4", "gguf"
    shape: tuple[int, ...]            # the logical (dequantized) shape
    rows: dict[str, torch.Tensor]
    consts: dict[str, torch.Tensor] = field(default_factory=dict)
    params: dict = field(default_factory=dict)  # non-tensor facts: quant type, rotation group size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return DEQUANTIZERS[self.format](self, dtype)

    def map_rows(self, transform: Optional[Callable[[torch.Tensor], torch.Tensor]]) -> "QuantWeight":
        """The weight with a row transform (narrow / reorder along dim 0) applied to every row part."""
        if transform is None:
            return self
        rows = {name: transform(part) for name, part in self.rows.items()}
        count = next(iter(rows.values())).shape[0]
        return replace(self, rows=rows, shape=(count, *self.shape[1:]))

    def to(self, device: torch.device) -> "QuantWeight":
        return replace(self, rows={k: v.to(device) for k, v in self.rows.items()},
                       consts={k: v.to(device) for k, v in self.consts.items()})

    def owned(self) -> "QuantWeight":
        """The weight with its CPU parts copied out of the file mapping they may view: a checkpoint rewritten on
        disk must not change a loaded model (as checkpoints.loading.out_of_file does for plain tensors)."""
        def own(part):
            return kept_copy(part) if part.device.type == "cpu" else part
        return replace(self, rows={k: own(v) for k, v in self.rows.items()},
                       consts={k: own(v) for k, v in self.consts.items()})

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.rows.values(), *self.consts.values()))


class QuantLinear(torch.nn.Module):
    """nn.Linear over a QuantWeight: a low-precision kernel when choose_kernels found one for its format on its
    device (`kernel`, formats.kernels), else the weight dequantized into the input's dtype for each call and dropped.

    LoRA deltas stay unmerged (`deltas`: (down [r, in], up [out, r], factor) low-rank pairs or (diff, None, factor)
    full differences), so the quantized base is never rewritten and removing a LoRA is exact.
    """

    def __init__(self, weight: QuantWeight, bias: Optional[torch.Tensor]):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.deltas: list[tuple[torch.Tensor, Optional[torch.Tensor], float]] = []
        self.kernel = None  # a formats.kernels.Choice; None: dequantize-then-matmul
        self._layout = (weight.format, weight.shape, weight.params, tuple(weight.rows), tuple(weight.consts))
        for name, part in {**weight.rows, **weight.consts}.items():  # buffers: moved and counted with the model
            self.register_buffer(f"quant_{name}", part, persistent=False)

    @property
    def quant(self) -> QuantWeight:
        """The QuantWeight over this module's buffers (wherever the module was moved)."""
        format_name, shape, params, row_names, const_names = self._layout
        return QuantWeight(format_name, shape, {n: getattr(self, f"quant_{n}") for n in row_names},
                           {n: getattr(self, f"quant_{n}") for n in const_names}, params)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        out = self._kernel_output(x, bias) if self.kernel is not None and self.kernel.run is not None else None
        if out is None:
            out = F.linear(x, self.quant.dequantize(x.dtype), bias)
        for first, up, factor in self.deltas:
            if up is None:
                out = out + factor * F.linear(x, first.to(x.dtype))
            else:
                out = out + factor * F.linear(F.linear(x, first.to(x.dtype)), up.to(x.dtype))
        return out

    def _kernel_output(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The kernel's output; None after a kernel refused this layer's operands (logged once; the layer then
        dequantizes, as ComfyUI's layers fall back)."""
        try:
            return self.kernel.run(self, x, bias)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError, ValueError) as error:
            from .kernels import fall_back
            self.kernel = fall_back(self.kernel, error)
            return None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.quant.format}"


def install_quant_linears(model: torch.nn.Module, weights: dict[str, QuantWeight],
                          state: dict[str, torch.Tensor]) -> None:
    """Replace each nn.Linear whose `<module>.weight` is in `weights` by a QuantLinear (its bias from `state`, the
    state dict loaded next)."""
    for key, weight in weights.items():
        module_name = key.rsplit(".", 1)[0]
        parent_name, _, child = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child)
        if tuple(weight.shape) != (old.out_features, old.in_features):
            raise ValueError(f"quantized weight {key!r} has shape {list(weight.shape)} but the model's layer is "
                             f"[{old.out_features}, {old.in_features}]")
        setattr(parent, child, QuantLinear(weight, state.get(f"{module_name}.bias")))


def choose_kernels(model: torch.nn.Module, device: torch.device, option: Optional[str] = None) -> dict[str, str]:
    """Give every QuantLinear of the model its matmul on `device` (formats.kernels.choose; option: the load option
    quant_kernels); returns per layer format the paths taken, e.g. {"int8_tensorwise convrot": "int8 (comfy-kitchen)
    x 12"} (the load status)."""
    from . import kernels
    chosen_mode = kernels.mode(option)
    taken: dict[str, dict[str, int]] = {}
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.kernel = kernels.choose(module.quant, torch.device(device), chosen_mode)
            labels = taken.setdefault(describe_weight(module.quant), {})
            labels[module.kernel.label()] = labels.get(module.kernel.label(), 0) + 1
    return {name: "; ".join(f"{label} x {count}" for label, count in labels.items())
            for name, labels in sorted(taken.items())}


def describe_weight(weight: QuantWeight) -> str:
    """A layer format as ComfyUI names it: float8_e4m3fn, int8_tensorwise convrot, mxfp8, nvfp4, gguf Q4_K, ..."""
    if weight.format != "scaled":
        return f"gguf {weight.params.get('type', '')}".strip() if weight.format == "gguf" else weight.format
    codes = weight.rows["codes"]
    name = "int8_tensorwise" if codes.dtype == torch.int8 else str(codes.dtype).replace("torch.", "")
    if "scale" in weight.rows and codes.dtype != torch.int8:
        name += " per-row"
    return name + (" convrot" if weight.params.get("group") else "")


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights as held: parameters, and quantized layers as stored (not other buffers such
    as rotary tables)."""
    tensors = list(model.parameters())
    tensors += [part for module in model.modules() if isinstance(module, QuantLinear)
                for part in (*module.quant.rows.values(), *module.quant.consts.values())]
    return sum(t.numel() * t.element_size() for t in tensors)
