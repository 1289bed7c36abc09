"""Attention benchmark of the parallel layouts: 1 (one process), u2, r2, cfg2 at world 2 and u2r2, u2cfg2 at world 4.

Each layout runs one attention call of the model's shape (B, S tokens, 24 heads) through the worker-side path
(cfg_parallel.run_forward -> sp_attention) on gloo CPU processes with 1 thread each; layout 1 is one process with
2 threads. cfg layouts get a batch of 2 (cond + uncond, split over the CFG groups), the others a batch of 1, and
layout 1 is measured at both. Also reported: the communication alone (ring: its R-1 k/v block shifts; Ulysses: its
two all-to-alls), to show what the ring's overlap has to hide.

World 4 on a 2-core machine is 2x oversubscribed: its numbers show overheads, not the speed of 4 devices.

Usage: python benchmarks/bench_layouts.py [--tokens 4096 16384] [--dtypes float32 bfloat16] [--repeats 3]
Writes benchmarks/results/layouts_cpu.json (and prints a table).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sp_runtime.cli.machine import hardware_label, median_time, write_json  # noqa: E402
from sp_runtime.local_ranks import run_distributed  # noqa: E402

HEADS = 24
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LAYOUTS = (("u2", 2, 1), ("r2", 2, 1), ("cfg2", 2, 2), ("u2r2", 4, 1), ("u2cfg2", 4, 2))  # name, world, batch


class AttentionOnly:
    """A WorkerModel whose forward is one sequence-parallel attention over x = q = k = v [B, S, H, D]."""

    def forward(self, x, timestep, inputs, out, ctx):
        from sp_runtime.attention import SeqShards, sp_attention
        seq = ctx.groups.seq
        shards = SeqShards.balanced(x.shape[1], seq.degree)
        lo, hi = shards.range(seq.rank)
        local = x[:, lo:hi]
        image, _ = sp_attention(local, local, local, seq, shards)
        out[:, lo:hi] = image


class BenchContext:
    def __init__(self, groups):
        self.device, self.groups = torch.device("cpu"), groups

    def to_device(self, name, tensor, dtype=None):
        return tensor

    def check_cancel(self):
        pass


def _single(tokens: int, head_dim: int, dtype: str, batch: int, repeats: int) -> float:
    from sp_runtime.attention import local_attention
    torch.set_num_threads(2)
    x = torch.randn(batch, tokens, HEADS, head_dim, dtype=DTYPES[dtype])
    return median_time(lambda: local_attention(x, x, x), repeats)


def _layout(rank, world_size, layout, tokens, head_dim, dtype, batch, repeats):
    import torch.distributed as dist

    from sp_runtime.cfg_parallel import run_forward
    from sp_runtime.config import SPConfig
    from sp_runtime.groups import build_groups
    groups = build_groups(SPConfig.from_layout(["cpu"] * world_size, layout))
    x = torch.randn(batch, tokens, HEADS, head_dim, dtype=DTYPES[dtype])
    out = torch.empty_like(x)
    ctx = BenchContext(groups)
    timestep = torch.zeros(batch)
    total = median_time(lambda: run_forward(AttentionOnly(), x, timestep, {}, out, ctx), repeats, dist.barrier)
    return total, _communication(groups, x, repeats)


def _communication(groups, x, repeats: int) -> float:
    """The exchanges of one call alone, with the buffers the cores send."""
    import torch.distributed as dist
    seq = groups.seq if x.shape[0] % groups.cfg_degree == 0 else groups.seq_all
    batch = x.shape[0] // groups.cfg_degree if seq is groups.seq else x.shape[0]
    tokens, head_dim = -(-x.shape[1] // seq.degree), x.shape[3]
    heads = -(-HEADS // seq.ulysses_degree)
    steps = []
    if seq.ulysses_degree > 1:
        qkv = torch.randn(3 * batch * tokens * HEADS * head_dim, dtype=x.dtype)
        back = torch.randn(batch * tokens * HEADS * head_dim, dtype=x.dtype)
        steps += [lambda send=send: dist.all_to_all_single(torch.empty_like(send), send, group=seq.ulysses_group)
                  for send in (qkv, back)]
    if seq.ring_degree > 1:
        blocks = torch.randn(2, batch, heads, tokens * seq.ulysses_degree, head_dim, dtype=x.dtype)
        ranks, ring = seq.ring_global_ranks, seq.ring_rank
        peers = ranks[(ring + 1) % seq.ring_degree], ranks[(ring - 1) % seq.ring_degree]

        def shift(send=blocks, receive=torch.empty_like(blocks)):
            for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peers[0], seq.ring_group),
                                                   dist.P2POp(dist.irecv, receive, peers[1], seq.ring_group)]):
                request.wait()
        steps += [shift] * (seq.ring_degree - 1)
    if not steps:
        return 0.0
    return median_time(lambda: [step() for step in steps], repeats, dist.barrier)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096])
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES))
    parser.add_argument("--layouts", nargs="+", default=[name for name, *_ in LAYOUTS])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "layouts_cpu.json"))
    args = parser.parse_args()
    rows = []
    load_before = os.getloadavg()
    for tokens in args.tokens:
        for dtype in args.dtypes:
            single = {batch: _single(tokens, args.head_dim, dtype, batch, args.repeats) for batch in (1, 2)}
            for batch, seconds in single.items():
                rows.append(_row("1", 1, tokens, args.head_dim, dtype, batch, seconds, 0.0, seconds))
            for name, world_size, batch in LAYOUTS:
                if name not in args.layouts:
                    continue
                per_rank = run_distributed(_layout, world_size, name, tokens, args.head_dim, dtype, batch,
                                           args.repeats, threads=1, timeout=3600)
                seconds = max(t for t, _ in per_rank)
                rows.append(_row(name, world_size, tokens, args.head_dim, dtype, batch, seconds,
                                 max(c for _, c in per_rank), single[batch]))
    result = {"benchmark": "attention layouts", "machine": hardware_label(["cpu"]), "torch": torch.__version__,
              "repeats": args.repeats,
              "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
              "note": "layout 1 = one process with 2 threads; others = gloo processes with 1 thread each "
                      "(world 4 is 2x oversubscribed on 2 cores); cfg layouts run a batch of 2 (cond + uncond), "
                      "the rest a batch of 1; speedup = layout 1 at the same batch / this layout; "
                      "communication_ms = the exchanges alone (not overlapped)",
              "rows": rows}
    write_json(args.out, result, say=True)


def _row(layout, world_size, tokens, head_dim, dtype, batch, seconds, communication, single) -> dict:
    row = {"layout": layout, "world_size": world_size, "tokens": tokens, "heads": HEADS, "head_dim": head_dim,
           "dtype": dtype, "batch": batch, "ms": round(seconds * 1e3, 1),
           "communication_ms": round(communication * 1e3, 1), "speedup_vs_1": round(single / seconds, 3)}
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()
