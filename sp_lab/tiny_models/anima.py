"""Tiny random-weight Anima models: the tiny Cosmos-Predict2 DiT (cosmos.py) with a 64-wide text (16 heads of 4, as
the adapter has 16) and its LLM adapter (sp_runtime's module: 2 layers, a 48-wide Qwen3 text, 100 T5 ids), written
in ComfyUI's key layout (`blocks.N.*` for the DiT, `llm_adapter.*` as they are)."""
from __future__ import annotations

import torch

from . import cosmos
from .weights import randomize_, sized

ANIMA_TINY = {**cosmos.COSMOS_TINY, "text_embed_dim": 64}
ADAPTER_TINY = dict(vocabulary=100, text_dim=48, layers=2)


def tiny_config(**size) -> dict:
    return sized("anima", ANIMA_TINY, size)


def build_tiny_model(seed: int = 0, **size) -> torch.nn.Module:
    """The DiT with `llm_adapter` attached, float32, seeded random weights."""
    import diffusers

    from sp_runtime.families.anima.text import LLMAdapter
    config = tiny_config(**size)
    model = diffusers.CosmosTransformer3DModel.from_config(config)
    model.llm_adapter = LLMAdapter(ADAPTER_TINY["vocabulary"], config["text_embed_dim"], ADAPTER_TINY["text_dim"],
                                   ADAPTER_TINY["layers"])
    randomize_(model, seed)
    return model.eval().requires_grad_(False)


def original_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """ComfyUI's names: the DiT's as cosmos.py writes them, the adapter's unchanged."""
    state = model.state_dict()
    adapter = {key: value.detach() for key, value in state.items() if key.startswith("llm_adapter.")}
    dit = {key: value for key, value in state.items() if not key.startswith("llm_adapter.")}
    return {**{cosmos._original_name(key): value.detach() for key, value in dit.items()}, **adapter}
