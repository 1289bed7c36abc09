"""The communication of one denoising step, computed from the model's shape and the layout: which exchanges run,
with which buffer sizes, how often, and how many bytes each rank sends over its links.

It follows what sp_runtime.attention sends: Ulysses' fused q/k/v all-to-all (tokens padded to the longest shard,
heads to a multiple of the degree) and the return all-to-all that carries the joint text output; the ring's k/v
block shifts and the all-gather of its text rows; CFG groups split an even batch, and a batch that cannot be
split runs on every rank, the CFG halves joined as more ring blocks. Tensor parallelism splits the heads first (the
Ulysses exchanges carry H/T of them) and all-reduces the attention and MLP outputs of every block (a ring all-reduce
sends 2 (T-1)/T of its buffer); the modulation all-gathers (a few numbers per item) are left out.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..attention.shards import SeqShards
from ..config import SPConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass(frozen=True)
class AttentionShape:
    """What the exchanges depend on: sequence attention layers, heads, head size and whether text joins them."""

    family: str
    layers: int
    heads: int
    head_dim: int
    joint_text: bool

    @classmethod
    def of(cls, family: str, config: dict) -> "AttentionShape":
        """From a ModelInfo config (or a diffusers config) of Qwen-Image, Flux or Wan."""
        if family == "wan":
            heads = config.get("num_heads") or config["num_attention_heads"]
            head_dim = config.get("head_dim") or config["attention_head_dim"]
            return cls(family, config["num_layers"], heads, head_dim, joint_text=False)
        layers = config["num_layers"] + config.get("num_single_layers", 0)
        return cls(family, layers, config["num_attention_heads"], config["attention_head_dim"], joint_text=True)


@dataclass(frozen=True)
class Exchange:
    """One kind of collective in a step: `elements` per rank per call (the send buffer), `calls` per step."""

    kind: str            # "all_to_all" (Ulysses group), "ring_shift" / "all_gather" (ring group), "all_reduce" (TP)
    name: str
    elements: int
    calls: int
    peers: int           # ranks in the group
    sent_fraction: float  # share of the buffer that leaves the rank (all-to-all keeps 1/P at home)

    def bytes_sent(self, element_bytes: int) -> int:
        """Bytes this rank sends to other ranks per step through this exchange."""
        return int(self.elements * element_bytes * self.sent_fraction * self.calls)


def sequence_layout(config: SPConfig, batch: int) -> tuple[int, int, int]:
    """(ulysses degree, ring degree, batch per sequence group) that a call of this batch runs with."""
    if config.cfg_degree > 1 and batch % config.cfg_degree == 0:
        return config.ulysses_degree, config.ring_degree, batch // config.cfg_degree
    return config.ulysses_degree, config.ring_degree * config.cfg_degree, batch


def step_exchanges(shape: AttentionShape, config: SPConfig, tokens: int, text_tokens: int,
                   batch: int) -> list[Exchange]:
    """Every exchange of one model call (one denoising step) on the busiest rank."""
    ulysses, ring, group_batch = sequence_layout(config, batch)
    shards = SeqShards.balanced(tokens, ulysses * ring)
    text = text_tokens if shape.joint_text else 0
    tp = config.tensor_parallel_degree
    heads_here = -(-(shape.heads // tp) // ulysses)
    layers = shape.layers
    exchanges = []
    if tp > 1:  # every block: attention output and MLP output, this rank's tokens and the text, the whole width
        exchanges.append(Exchange("all_reduce", "tensor-parallel attention / MLP output all-reduce",
                                  group_batch * (shards.chunk + text) * shape.heads * shape.head_dim,
                                  2 * layers, tp, 2 * (tp - 1) / tp))
    if ulysses > 1:
        chunk = max(shards.block(r * ulysses, ulysses).chunk for r in range(ring))
        fraction = (ulysses - 1) / ulysses
        exchanges.append(Exchange("all_to_all", "ulysses q/k/v to heads",
                                  ulysses * 3 * group_batch * heads_here * chunk * shape.head_dim, layers, ulysses,
                                  fraction))
        exchanges.append(Exchange("all_to_all", "ulysses output to tokens" + (" (+ text)" if text else ""),
                                  ulysses * group_batch * heads_here * (chunk + text) * shape.head_dim, layers,
                                  ulysses, fraction))
    if ring > 1:
        block = max(shards.block(r * ulysses, ulysses).total for r in range(ring))
        exchanges.append(Exchange("ring_shift", "ring k/v block shift",
                                  2 * group_batch * heads_here * block * shape.head_dim, layers * (ring - 1), ring,
                                  1.0))
        if text:
            rows = -(-text // ring)
            exchanges.append(Exchange("all_gather", "ring text rows all-gather",
                                      group_batch * heads_here * rows * shape.head_dim, layers, ring,
                                      float(ring - 1)))
    return exchanges


def bytes_per_step(exchanges: list[Exchange], dtype: str) -> int:
    size = DTYPE_BYTES.get(dtype, 4)
    return sum(exchange.bytes_sent(size) for exchange in exchanges)
