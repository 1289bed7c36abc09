"""What a model family brings to the shared conformance suite (tests/families/test_family_conformance.py), keyed by
family name (or "family:variant" for a variant of the family checked as a model of its own): a tiny checkpoint
writer, its single-device reference forward and ComfyUI's calls to check them on.
The suite runs every registered family through the pool with them (load, parity at every layout, a quantized file,
a LoRA); a family's own test file keeps only what is special to it.

The product's families are declared in `product.py`; the lab's in `lab.py`; a family registered elsewhere (a test's
throwaway family) declares its own with `register_conformance` when it registers.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

Case = tuple  # (x, timestep, inputs): one ComfyUI call of the diffusion model


@dataclass(frozen=True)
class Conformance:
    """write(folder) -> the path written there: the family's tiny float32 checkpoint (a file in the layout users have).
    reference(path) -> forward(x, timestep, **inputs): the single-device reference of the model `write` wrote (the
        product's families: diffusers' stock forward on the same weights built in memory, not read back).
    cases() -> {name: (x, timestep, inputs)}: ComfyUI's calls; odd token counts, batch 2, fewer tokens than ranks.
    other_files: {name: write(folder)}: the same weights in the other layouts the family reads; each is loaded at
        degree 1 and runs `cases()[load_case]` (loading differs between them, the forward does not).
    load_case: the case of the load, quantized-file and LoRA checks (default: the first).
    cfg: the family is sampled with CFG, so it is also checked under Ulysses 2 x CFG 2.
    layout_cases: the cases run under the Ring, hybrid and CFG layouts (default: all).
    quantized(path, reference_path): writes a quantized file of the family and the float32 weights it encodes;
        None for a family that reads no quantized files.
    load_options: keyword arguments of every load (e.g. Wan's head size).
    reference_model(model) -> the model `reference` takes, from the one the family's single-device loader builds (for
        file_reference; default: that model).
    tensor_parallel: why the family refuses tensor parallelism ("": it serves it, and is checked at TP 2).
    """
    write: Callable[[str], str]
    reference: Callable[[str], Callable]
    cases: Callable[[], dict]
    other_files: dict = field(default_factory=dict)
    load_case: str = ""
    cfg: bool = True
    layout_cases: tuple = ()
    quantized: Optional[Callable[[str, str], Any]] = None
    load_options: dict = field(default_factory=dict)
    reference_model: Optional[Callable[[Any], Any]] = None
    tensor_parallel: str = ""

    @property
    def first_case(self) -> str:
        """The name of the case the load, quantized-file and LoRA checks run."""
        return self.load_case or next(iter(self.cases()))

    def case(self) -> Case:
        return self.cases()[self.first_case]


CONFORMANCE: dict[str, Conformance] = {}


def register_conformance(family: str, spec: Conformance) -> None:
    CONFORMANCE[family] = spec


def not_yet() -> dict[str, str]:
    """Registered families the suite does not cover yet, with the reason (each entry is a debt)."""
    from . import lab, product
    return {**product.NOT_YET, **lab.NOT_YET}


def conformance(family: str) -> Conformance:
    """The family's spec; ValueError naming where to declare it otherwise."""
    if family not in CONFORMANCE:
        raise ValueError(f"model family {family!r} declares no conformance spec: add one to sp_lab/conformance/"
                         f"product.py (a product family) or call register_conformance where it is registered")
    return CONFORMANCE[family]


def file_reference(family: str, path: str) -> Callable:
    """The reference forward of the model in `path` as the family's single-device loader reads it (for files written
    from other weights: a quantized file's dequantized weights, a LoRA merged by hand)."""
    from sp_lab.references import reference_forward
    from sp_runtime.families import family as family_of
    name, family = family, family.partition(":")[0]
    load_model = family_of(family).load_model
    model = load_model(path, "float32")[0] if load_model is not None else path
    as_reference = CONFORMANCE[name].reference_model if name in CONFORMANCE else None
    return functools.partial(reference_forward(family), as_reference(model) if as_reference else model)


from . import lab, product  # noqa: E402,F401  (they register the lab's and the product's specs)
