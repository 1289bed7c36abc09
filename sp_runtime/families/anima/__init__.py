"""Anima (Cosmos-Predict2 2B with an LLM adapter): ComfyUI's Anima (comfy/ldm/anima/model.py), a MiniTrainDIT whose
T5 context is made by an LLM adapter from Qwen3 hidden states and T5 token ids; on diffusers'
CosmosTransformer3DModel plus our adapter module (text.py: diffusers has no class for it).

Plan (plan.py): Cosmos-Predict2's (one split "video" stream, self-attention through the executor, local
cross-attention to the replicated text) with the adapter run whole on every rank before the blocks, like a replicated
text stream. ComfyUI runs the adapter in extra_conds; its host here packs the adapter's inputs into c_crossattn
(text.pack) and the workers unpack them. Learnable extra positions, padding masks and per-frame timesteps are refused
by name (as for Cosmos-Predict2).
"""
from __future__ import annotations

from ..family import Family, PlanModel
from ..cosmos.detection import CLASS_NAME, UNUSED
from .detection import CONFIG_KEYS, NAME, detect
from .host import COMFY
from .keys import original_plan, weight_plan
from .plan import PLAN


def build(model_class, config: dict, dtypes):
    """The empty Cosmos DiT (meta weights) with our LLM adapter as `llm_adapter`."""
    from accelerate import init_empty_weights

    from ...checkpoints.loading import build_empty_model
    from ..cosmos.detection import FOLDER_KEYS
    from .text import LLMAdapter
    model = build_empty_model(model_class, {key: config[key] for key in FOLDER_KEYS if key in config}, dtypes)
    with init_empty_weights():
        model.llm_adapter = LLMAdapter(config["adapter_vocabulary"], config["adapter_width"],
                                       config["adapter_text_dim"], config["adapter_layers"],
                                       config["adapter_self_attention"])
    return model


def describe(model, detection) -> dict:
    return {key: detection.config[key] for key in CONFIG_KEYS if key.startswith("adapter_")}


MODEL = PlanModel(NAME, "Anima", CLASS_NAME, detect, weight_plan, PLAN, 5, CONFIG_KEYS, ignore=UNUSED, build=build,
                  describe=describe)
load, load_model = MODEL.load, MODEL.load_model

FAMILY = Family(NAME, "Anima (Cosmos-Predict2 with an LLM adapter)", detect, load, COMFY, weight_plan, original_plan,
                load_model, signatures=("llm_adapter.out_proj.weight",))

__all__ = ["FAMILY", "CONFIG_KEYS", "COMFY", "MODEL", "NAME", "PLAN", "detect", "load", "load_model", "original_plan",
           "weight_plan"]
