"""Opt-in torch.compile of a loaded model's transformer blocks (load option compile=True), and the graph breaks
it took. The sequence-parallel exchanges stay outside the graphs (sp_attention's distributed path is excluded from
compilation): one break per attention with more than one rank, none at one rank. The first call of each new shape
compiles (warm-up, minutes with inductor; load option compile_backend picks another torch.compile backend, e.g.
"aot_eager": seconds); later calls reuse the graphs. Tensor parallelism's collectives are traced into the graphs
(sp.tensor_parallel)."""
from __future__ import annotations

import torch

BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks", "blocks")  # Flux / Qwen-Image, Flux, Wan


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [block for name in BLOCK_LISTS for block in getattr(model, name, None) or []]


def compile_blocks(model: torch.nn.Module, **compile_options) -> int:
    """Compile every transformer block of a diffusers model in place; returns how many."""
    blocks = transformer_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no transformer blocks ({', '.join(BLOCK_LISTS)}) to compile; "
                         f"load it without compile=True")
    for block in blocks:
        block.compile(**compile_options)
    return len(blocks)


def graph_breaks() -> dict[str, int]:
    """Graph breaks dynamo took in this process so far: reason -> count."""
    from torch._dynamo.utils import counters
    return {str(reason)[:300]: count for reason, count in counters["graph_break"].items()}
