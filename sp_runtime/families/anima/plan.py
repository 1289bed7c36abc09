"""Anima's sequence-parallel plan: Cosmos-Predict2's (cosmos.PLAN) with the LLM adapter before it. The adapter runs
whole on every rank (a replicated text stream: no communication) in `condition`, from the call's adapter inputs in
one of ComfyUI's two forms: the host's packed prompt (text.pack: what ComfyUI's Anima puts in c_crossattn when it
samples; each item run alone, as ComfyUI runs it per conditioning) or the Qwen3 states as context with t5xxl_ids /
t5xxl_weights (ComfyUI's Anima.forward); a context without ids is the DiT's context already, as in ComfyUI."""
from __future__ import annotations

from dataclasses import replace

import torch

from ...sp.cross import Context
from ..cosmos import plan as cosmos
from . import text


def check(call) -> None:
    cosmos.check_latent(call)
    context, ids = call.inputs.get("context"), call.inputs.get("t5xxl_ids")
    if context is not None and text.is_packed(context):
        if ids is not None:
            raise ValueError("Anima takes t5xxl_ids or a packed prompt as context, not both")
        return
    if ids is None:
        if call.inputs.get("t5xxl_weights") is not None:
            raise ValueError("Anima's t5xxl_weights come with t5xxl_ids (none given)")
        cosmos.check_context(context, call, what="Anima without t5xxl_ids needs the LLM adapter's output as context",
                             source="ComfyUI's preprocess_text_embeds")
        return
    cosmos.check_context(context, call, call.worker.info.config["adapter_text_dim"], "Anima needs context",
                         "the Qwen3 text encoder output")
    weights = call.inputs.get("t5xxl_weights")
    if ids.dim() != 2 or ids.shape[0] not in (1, call.x.shape[0]) or ids.is_floating_point():
        raise ValueError(f"Anima's t5xxl_ids must be integer token ids [B, L]; got {ids.dtype} {list(ids.shape)}")
    if weights is not None and weights.numel() != ids.numel():
        raise ValueError(f"Anima's t5xxl_weights {list(weights.shape)} must give one weight per t5xxl_ids token "
                         f"{list(ids.shape)}")


def condition(call) -> None:
    """The DiT's context (the adapter's output) replicated on every rank, and Cosmos' time embedding."""
    context = dit_context(call)
    call.text = Context(context.expand(call.batch, *context.shape[1:]))
    cosmos.embed_time(call)


def dit_context(call) -> torch.Tensor:
    context, adapter = call.input("context"), call.model.llm_adapter
    if text.is_packed(context):
        items = [text.context(adapter, *text.unpack(item)) for item in context]
        if len({item.shape[1] for item in items}) > 1:
            raise ValueError(f"Anima prompts of more than {text.CONTEXT_TOKENS} T5 tokens batched with prompts of "
                             f"another length ({[item.shape[1] for item in items]} tokens) are not supported")
        return torch.cat(items)
    if call.inputs.get("t5xxl_ids") is None:
        return context
    ids = call.input("t5xxl_ids", torch.long)
    weights = call.inputs.get("t5xxl_weights")
    batch = max(context.shape[0], ids.shape[0])
    weights = None if weights is None else call.input("t5xxl_weights").reshape(ids.shape[0], -1, 1)
    return text.context(adapter, context.expand(batch, -1, -1), ids.expand(batch, -1),
                        None if weights is None else weights.expand(batch, -1, -1))


PLAN = replace(cosmos.PLAN, check=check, condition=condition)
