"""HiDream-O1's key plan: ComfyUI's names -> our HiDreamO1Transformer's (model.py): the decoder's
`language_model.{embed_tokens,layers,norm}` at the top level (`layers` is the executor's block list); the vision
tower's deepstack mergers `visual.deepstack_merger_list.*` (unused: ComfyUI drops them too) are read past and dropped;
everything else keeps its name (the vision tower `visual.*`, vision.py)."""
from __future__ import annotations

from typing import Iterable

from ...checkpoints.loading import KeyPlan, original_layout_plan

DECODER = "language_model."
DROPPED = "visual.deepstack_merger_list."


def original_plan(keys: Iterable[str], config=None) -> KeyPlan:
    plan = {}
    for key in keys:
        if key.startswith(DROPPED):
            plan[key] = []
        else:
            plan[key] = [(key[len(DECODER):] if key.startswith(DECODER) else key, None)]
    return plan


weight_plan = original_layout_plan(original_plan)
