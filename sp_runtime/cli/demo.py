"""Demo placeholder: checks Ulysses attention on 2 CPU processes against single-process SDPA."""
from __future__ import annotations

import time

import torch


def add_arguments(parser) -> None:
    parser.add_argument("--tokens", type=int, default=4099, help="sequence length (default: 4099, uneven on purpose)")
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--world", type=int, default=2, help="number of CPU processes")


def _check(rank, world_size, tokens, heads):
    from sp_runtime.attention import SeqShards, sp_attention
    from sp_runtime.config import SPConfig
    from sp_runtime.groups import build_groups
    seq = build_groups(SPConfig(["cpu"] * world_size)).seq
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, tokens, heads, 64, generator=gen) for _ in range(3))
    shards = SeqShards.balanced(tokens, world_size)
    lo, hi = shards.range(rank)
    start = time.perf_counter()
    out, _ = sp_attention(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], seq, shards)
    elapsed = time.perf_counter() - start
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)[:, lo:hi]
    return (out - ref).abs().max().item(), elapsed


def run(args) -> int:
    from sp_runtime.testing.spawn import run_distributed
    print(f"Ulysses attention check: {args.tokens} tokens, {args.heads} heads on {args.world} CPU processes")
    results = run_distributed(_check, args.world, args.tokens, args.heads)
    worst = max(err for err, _ in results)
    print(f"max abs difference vs single-process SDPA: {worst:.2e} "
          f"({'OK' if worst <= 1e-5 else 'MISMATCH'}); attention time {max(t for _, t in results) * 1e3:.0f} ms")
    return 0 if worst <= 1e-5 else 1
