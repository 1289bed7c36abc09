"""Per-rank peak memory of masked sp_attention vs sequence length, for a block-structured mask (LTX-2's guide mask:
the last eighth of the tokens weighted guides at strength 0.7): the query-tiled path against the same mask asked for
whole [rows, S] blocks (what an unstructured mask costs), at Ulysses 2 and Ring 2 on CPU ranks.

Each rank measures its own peak RSS during one call (VmHWM reset through /proc/self/clear_refs; glibc returns big
frees to the OS, so RSS tracks live memory) less its RSS before the call, and the largest mask block it was asked for.

Usage: python benchmarks/bench_mask_memory.py [--tokens 2048 4096 8192 16384] [--untiled-up-to 8192]
Writes benchmarks/results/mask_memory_cpu.json (and prints a table).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sp_runtime.cli.machine import hardware_label, write_json  # noqa: E402
from sp_runtime.local_ranks import run_distributed  # noqa: E402

HEADS, HEAD_DIM = 4, 32
MIB = 2 ** 20
LAYOUTS = {"u2": dict(ulysses_degree=2), "r2": dict(ulysses_degree=1, ring_degree=2)}


def _status(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _rank(rank, world_size, layout, tokens, tiled):
    import sp_runtime.attention.masks as masks
    from sp_runtime.attention import SeqShards, sp_attention
    from sp_runtime.config import SPConfig
    from sp_runtime.families.ltx2.guides import GuideMask, log_weights
    from sp_runtime.groups import build_groups
    torch.set_num_threads(1)
    if not tiled:
        masks.TILE_ROWS = tokens  # whole query blocks: the mask memory an unstructured mask needs
    seq = build_groups(SPConfig(["cpu"] * world_size, **LAYOUTS[layout])).seq
    shards = SeqShards.balanced(tokens, world_size)
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, shards.sizes[rank], HEADS, HEAD_DIM, generator=gen) for _ in range(3))
    guides = tokens // 8
    mask = GuideMask(tokens - guides, log_weights(torch.full((guides,), 0.7), torch.float32))
    largest = [0]
    block = mask.block

    def counted(rows, cols, device):
        out = block(rows, cols, device)
        largest[0] = max(largest[0], 0 if out is None else out.numel())
        return out
    mask.block = counted
    sp_attention(q, k, v, seq, shards, mask=mask)  # warm-up
    with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
        handle.write("5")
    before = _status("VmRSS")
    sp_attention(q, k, v, seq, shards, mask=mask)
    return {"activation_mib": (_status("VmHWM") - before) / MIB, "largest_mask_block": largest[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--untiled-up-to", type=int, default=8192)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "mask_memory_cpu.json"))
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)  # the spawned ranks inherit it
    rows = []
    for layout in LAYOUTS:
        for tokens in args.tokens:
            for tiled in (True, False):
                if not tiled and tokens > args.untiled_up_to:
                    continue
                ranks = run_distributed(_rank, 2, layout, tokens, tiled, timeout=600)
                row = {"layout": layout, "tokens": tokens, "query_tiles": tiled,
                       "max_activation_mib": max(r["activation_mib"] for r in ranks),
                       "largest_mask_block": max(r["largest_mask_block"] for r in ranks),
                       "dense_mask_mib": tokens * tokens * 4 / MIB}
                rows.append(row)
                print(f"{layout:3} S={tokens:6} tiles={str(tiled):5} peak {row['max_activation_mib']:8.1f} MiB  "
                      f"largest mask block {row['largest_mask_block']:>10} elements  (dense S x S fp32: "
                      f"{row['dense_mask_mib']:.0f} MiB)", flush=True)
    write_json(args.out, {"what": __doc__.split("\n\n")[0], "hardware": hardware_label(["cpu"]),
                          "heads": HEADS, "head_dim": HEAD_DIM, "dtype": "float32", "batch": 1,
                          "tile_rows": __import__("sp_runtime.attention.masks", fromlist=["TILE_ROWS"]).TILE_ROWS,
                          "results": rows}, say=True)


if __name__ == "__main__":
    main()
