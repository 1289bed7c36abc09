"""Where a LoRA module lands in a loaded diffusers model: the LoRA's module name, in any of the naming schemes
ComfyUI accepts for the family, resolved to model parameters through the family's own checkpoint key plan.

A name is tried as the model's own (diffusers) name, then as an original / ComfyUI name through the family's
`original_plan`, the plan it loads original-layout checkpoints with (Qwen-Image's ComfyUI names are diffusers'), so a
fused Flux `img_attn.qkv` LoRA is split into to_q / to_k / to_v exactly as the weights were.
Prefixes (comfy/lora.py `model_lora_keys_unet`): `diffusion_model.`, `transformer.`, `base_model.model.`, none;
underscored kohya names after `lora_unet_`, `lora_transformer_` or `lycoris_`; Wan Fun's `lora_unet__`
(comfy/lora_convert.py).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from .. import families
from ..contract import Detection
from ..checkpoints.loading import KeyPlan, Transform

DOTTED_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "base_model.model.transformer.",
                   "base_model.model.", "transformer.", "unet.")
UNDERSCORED_PREFIXES = ("lora_unet_", "lora_transformer_", "lycoris_")
# plan lookups a LoRA file's unknown kohya names may cost all together: a real file needs a few hundred (one search
# per name pattern, e.g. 8 for "double_blocks_N_img_attn_qkv"); a crafted one is refused at once, not after hours
MAX_DECODE_LOOKUPS = 4096
PlanFn = Callable[[Iterable[str]], dict]
WeightPlanFn = Callable[[Detection, Iterable[str]], Optional[KeyPlan]]  # a Family's weight_plan


@dataclass(frozen=True)
class Target:
    """A model parameter a LoRA module changes; `transform` maps the module's delta (in the LoRA's key space,
    e.g. a fused qkv) onto this parameter, as the key plan maps checkpoint tensors. Plan transforms select or
    reorder rows, so they apply to a delta as they apply to a weight."""

    parameter: str
    transform: Transform = None


def family_plans(family: str, model: torch.nn.Module) -> tuple[PlanFn, WeightPlanFn]:
    """The family's plans: from original (ComfyUI / reference release) key names to `model`'s parameters,
    and the weight_plan its loader reads checkpoints with."""
    entry = families.family(family) if family in families.FAMILIES else None
    if entry is None or entry.weight_plan is None:
        supported = [found.name for found in families.families() if found.weight_plan is not None]
        raise ValueError(f"LoRA is not supported for {family!r} models (supported: {', '.join(supported)})")
    return (lambda keys: entry.original_plan(keys, model.config)), entry.weight_plan


class KeyResolver:
    """Resolves LoRA module names to Targets of one model. `known_keys`: other key names the LoRA may use (the
    base checkpoint's own, e.g. original Flux names), used to decode underscored names without guessing."""

    def __init__(self, parameters: Iterable[str], plan: PlanFn, known_keys: Iterable[str] = ()):
        self.parameters = set(parameters)
        self.plan = plan
        self.patterns: dict[tuple, Optional[tuple[str, ...]]] = {}  # decoded name patterns (see _decode)
        self.lookups_left = MAX_DECODE_LOOKUPS
        self.underscored = {}
        for key in itertools.chain(self.parameters, known_keys):
            module = key.rsplit(".", 1)[0]
            self.underscored.setdefault(module.replace(".", "_"), module)

    def resolve(self, module: str, kind: str) -> Optional[list[Target]]:
        """Targets of a LoRA module changing its `kind` ("weight" / "bias"); None when no name scheme fits."""
        if module.startswith("lora_unet__"):  # Wan Fun LoRAs (comfy/lora_convert.py convert_lora_wan_fun)
            module = "lora_unet_" + module[len("lora_unet__"):]
        for prefix in UNDERSCORED_PREFIXES:
            if module.startswith(prefix):
                return self._resolve_underscored(module[len(prefix):], kind)
        for prefix in DOTTED_PREFIXES + ("",):
            if module.startswith(prefix):
                targets = self.resolve_dotted(module[len(prefix):], kind)
                if targets:
                    return targets
        return None

    def resolve_dotted(self, module: str, kind: str) -> Optional[list[Target]]:
        key = f"{module}.{kind}"
        if key in self.parameters:
            return [Target(key)]
        try:
            mapped = self.plan([key]).get(key)
        except (ValueError, KeyError):  # a name that is no key of this family at all
            mapped = None
        if mapped and all(parameter in self.parameters for parameter, _ in mapped):
            return [Target(parameter, transform) for parameter, transform in mapped]
        return None

    def _resolve_underscored(self, name: str, kind: str) -> Optional[list[Target]]:
        if name in self.underscored:
            found = self.resolve_dotted(self.underscored[name], kind)
            if found:
                return found
        return self._decode(name, kind)

    def reset_budget(self) -> None:
        """A fresh budget of plan lookups for decoding the names of one LoRA file (or one set of ComfyUI patches)."""
        self.lookups_left = MAX_DECODE_LOOKUPS

    def _decode(self, name: str, kind: str) -> Optional[list[Target]]:
        """A kohya name that neither the model nor the base checkpoint spells (e.g. original Flux names on a model
        loaded from a diffusers file). Block indices are always their own segment, so a name's pattern is its words
        with the indices left out; the "_" / "." choice between words is found once per pattern, within the file's
        budget of plan lookups, and reused for every block. Two spellings that both resolve would be ambiguous:
        refuse rather than pick one."""
        parts = name.split("_")
        pattern = tuple("#" if part.isdigit() else part for part in parts) + (kind,)
        if pattern not in self.patterns:
            self.patterns[pattern] = self._find_joins(parts, kind)
        joins = self.patterns[pattern]
        return None if joins is None else self.resolve_dotted(_spelled(parts, joins), kind)

    def _find_joins(self, parts: list[str], kind: str) -> Optional[tuple[str, ...]]:
        free = [index for index in range(len(parts) - 1) if not (parts[index].isdigit() or parts[index + 1].isdigit())]
        spellings = 2 ** len(free)
        if spellings > self.lookups_left:
            raise ValueError(f"the LoRA module name {'_'.join(parts)!r} has {spellings} possible spellings, more than "
                             f"the {self.lookups_left} left of this file's limit of {MAX_DECODE_LOOKUPS} name "
                             f"lookups: it is no module name of this model (name modules as the model, its "
                             f"checkpoint or ComfyUI does)")
        self.lookups_left -= spellings
        found: dict[str, tuple[str, ...]] = {}
        for choice in itertools.product("_.", repeat=len(free)):
            joins = ["."] * (len(parts) - 1)
            for index, join in zip(free, choice):
                joins[index] = join
            dotted = _spelled(parts, joins)
            if self.resolve_dotted(dotted, kind):
                found[dotted] = tuple(joins)
        if len(found) > 1:
            raise ValueError(f"the LoRA module name {'_'.join(parts)!r} fits several weights ({sorted(found)}): "
                             f"ambiguous")
        return next(iter(found.values()), None)


def _spelled(parts: list[str], joins) -> str:
    return parts[0] + "".join(join + part for join, part in zip(joins, parts[1:]))
