"""The extension protocol of Wan's variants: a variant is one module that states what it adds to the base (detection
facts as data, its modules, its inputs and the hooks of the plan) in a Variant and registers it; the base reads
REGISTRY and never imports a variant.

Hooks of one call, in the plan's order (each optional, `call` is the executor's Call; the base's state on it:
call.video (this rank's states), call.context (sp.cross.Context), call.block_modulation, call.out_modulation):
check(call); layout(call, streams) edits the streams (parts of "video", more streams); timesteps(call, sigma) ->
the timestep entries; embed(call) adds per-token terms after the patch embedding; prepare(call) per-call state;
before(call, index, block) / after(call, index, block) around each main block; block(block, call) -> new video
states instead of the stock block call; head(call) -> the output tokens instead of the stock head.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

Hook = Optional[Callable[..., Any]]


@dataclass(frozen=True)
class Variant:
    """One Wan variant. applies(model, variant) -> bool: whether a loaded model (of that Detection.variant) has the
    variant's parts.

    Detection: architecture(keys, layout, config) -> config entries (called when a header key starts with `anchor`);
    variant(config) -> the Detection.variant name or None (variants are asked in registration order, before the
    base's T2V / I2V / TI2V rules); own_keys: key prefixes named the same in both layouts (top level, or inside
    a block: block_keys); key_targets(key) -> [(diffusers key, transform)] ([] to skip, None: unknown) for the
    original keys under the prefixes mapped_keys;
    rename(key) -> the original name of a key of its own layouts; layouts: block anchors of those layouts (in place
    of blocks.0.self_attn.q.weight), model_type: ComfyUI's metadata name of the variant, marked(config, path) ->
    config entries of a file in one of those layouts or with that metadata (original_class: its folder's class).
    Loading: model_class (diffusers' class name), config_keys (config entries that are not diffusers' arguments,
    given to attach(model, entries)), info(model) -> ModelInfo.config entries, comfy (variant -> ComfyUI class).
    Calls: tensor_parallel (its hooks leave the blocks as the base's: TP splits them the same), inputs (ComfyUI
    inputs it takes), appended (the input whose frames follow x's, default time_dim_concat), rope_options (False:
    ScaleROPE refused by name), also (ModuleLists its hooks run).
    """

    name: str
    applies: Callable[[Any, str], bool]
    anchor: Any = None  # a key prefix, or a tuple of them
    architecture: Hook = None
    variant: Hook = None
    own_keys: tuple[str, ...] = ()
    block_keys: tuple[str, ...] = ()
    key_targets: Hook = None
    mapped_keys: tuple[str, ...] = ()
    rename: Hook = None
    layouts: tuple[str, ...] = ()
    model_type: Optional[str] = None
    marked: Hook = None
    original_class: Optional[str] = None
    model_class: Optional[str] = None
    config_keys: tuple[str, ...] = ()
    attach: Hook = None
    info: Hook = None
    comfy: dict = field(default_factory=dict)
    tensor_parallel: bool = False
    inputs: dict = field(default_factory=dict)  # Detection.variant -> inputs
    appended: str = "time_dim_concat"
    rope_options: bool = True
    also: tuple[str, ...] = ()
    check: Hook = None
    layout: Hook = None
    timesteps: Hook = None
    embed: Hook = None
    prepare: Hook = None
    before: Hook = None
    after: Hook = None
    block: Hook = None
    head: Hook = None


REGISTRY: list[Variant] = []


def register(variant: Variant) -> Variant:
    """Add (or replace, by name) a variant; returns it."""
    REGISTRY[:] = [known for known in REGISTRY if known.name != variant.name] + [variant]
    return variant


def variants_of(model, variant: str) -> list[Variant]:
    """The registered variants a loaded model (of that Detection.variant) has."""
    return [known for known in REGISTRY if known.applies(model, variant)]


def variant_inputs() -> dict[str, tuple[str, ...]]:
    """Detection.variant -> the inputs its variant modules take (ComfyUI would use them: never ignored silently)."""
    taken: dict[str, tuple[str, ...]] = {}
    for variant in REGISTRY:
        for name, inputs in variant.inputs.items():
            taken[name] = taken.get(name, ()) + tuple(inputs)
    return taken
