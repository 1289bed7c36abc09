"""Attention benchmark: one process with 2 threads vs Ulysses at world 2 (1 thread each), with the all-to-all share.

Usage: python benchmarks/bench_attention.py [--tokens 4096 16384] [--head-dims 64 128] [--repeats 3]
Writes benchmarks/results/attention_cpu.json (and prints a table).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sp_runtime.cli.machine import hardware_label, median_time, write_json  # noqa: E402
from sp_runtime.local_ranks import run_distributed  # noqa: E402

HEADS = 24
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _single(tokens: int, head_dim: int, dtype: str, repeats: int) -> float:
    torch.set_num_threads(2)
    q, k, v = (torch.randn(1, HEADS, tokens, head_dim, dtype=DTYPES[dtype]) for _ in range(3))
    return median_time(lambda: F.scaled_dot_product_attention(q, k, v), repeats)


def _ulysses(rank, world_size, tokens, head_dim, dtype, repeats):
    import torch.distributed as dist

    from sp_runtime.attention import SeqShards, sp_attention
    from sp_runtime.config import SPConfig
    from sp_runtime.groups import build_groups
    seq = build_groups(SPConfig(["cpu"] * world_size)).seq
    shards = SeqShards.balanced(tokens, world_size)
    local = shards.sizes[rank]
    q, k, v = (torch.randn(1, local, HEADS, head_dim, dtype=DTYPES[dtype]) for _ in range(3))
    total = median_time(lambda: sp_attention(q, k, v, seq, shards), repeats, dist.barrier)
    # The two exchanges alone, with the buffers Ulysses sends: q, k, v out and the output back.
    send_qkv = torch.randn(3 * local * HEADS * head_dim, dtype=DTYPES[dtype])
    send_out = torch.randn(local * HEADS * head_dim, dtype=DTYPES[dtype])

    def exchanges():
        for send in (send_qkv, send_out):
            dist.all_to_all_single(torch.empty_like(send), send)
    exchange = median_time(exchanges, repeats, dist.barrier)
    return total, exchange


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "attention_cpu.json"))
    args = parser.parse_args()
    rows = []
    for tokens in args.tokens:
        for head_dim in args.head_dims:
            for dtype in args.dtypes:
                single = _single(tokens, head_dim, dtype, args.repeats)
                per_rank = run_distributed(_ulysses, 2, tokens, head_dim, dtype, args.repeats, threads=1,
                                           timeout=3600)
                ulysses = max(t for t, _ in per_rank)
                exchange = max(e for _, e in per_rank)
                row = {"tokens": tokens, "heads": HEADS, "head_dim": head_dim, "dtype": dtype,
                       "single_2threads_ms": round(single * 1e3, 1), "ulysses_w2_ms": round(ulysses * 1e3, 1),
                       "ratio_w2_over_single": round(ulysses / single, 3),
                       "all_to_all_ms": round(exchange * 1e3, 1), "all_to_all_share": round(exchange / ulysses, 3)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    write_json(args.out, {
        "benchmark": "attention", "machine": hardware_label(["cpu"]), "torch": torch.__version__,
        "repeats": args.repeats,
        "note": "single = one process with 2 threads; ulysses_w2 = 2 gloo processes with 1 thread each",
        "rows": rows}, say=True)


if __name__ == "__main__":
    main()
