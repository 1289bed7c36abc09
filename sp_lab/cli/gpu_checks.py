"""The measurements of the GPU suite that run inside spawned ranks or on one device: attention parity of every
layout against plain SDPA (with FP8 exchange and overlap variants), the all-to-all sweep plain vs FP8, FP8
quantization error, and compiled-vs-eager model calls. They run on CPU too (gloo), which is how they are tested.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from sp_runtime.cli.machine import device_sync, median_time, timings

FP8_TOLERANCE = 0.1  # max |error| / output scale accepted with FP8 exchange (e4m3 keeps 3 mantissa bits)


@dataclass(frozen=True)
class AttentionCase:
    name: str
    tokens: int
    heads: int
    head_dim: int
    text: int
    masked: bool
    batch: int
    dtype: str

    def inputs(self, device: torch.device, seed: int):
        generator = torch.Generator().manual_seed(seed)
        dtype = getattr(torch, self.dtype)

        def draw(length):
            return torch.randn(self.batch, length, self.heads, self.head_dim, generator=generator).to(device, dtype)
        q, k, v = draw(self.tokens), draw(self.tokens), draw(self.tokens)
        text = tuple(draw(self.text) for _ in range(3)) if self.text else None
        mask = None
        if self.masked:
            mask = torch.ones(self.batch, self.text, dtype=torch.bool)
            mask[0, self.text // 2:] = False  # the first prompt is shorter: padded text keys
            mask = mask.to(device)
        return q, k, v, text, mask


def reference_attention(q, k, v, text, mask):
    """Plain SDPA over [text, image] in float32 (independent of sp_runtime.attention): (image out, text out)."""
    from sp_lab.families.toy import plain_joint_attention
    text = None if text is None else tuple(part.float() for part in text)
    return plain_joint_attention(q.float(), k.float(), v.float(), text, mask)


def attention_parity(rank: int, devices: list[str], layout: dict, cases: list[dict],
                     variants: list[dict]) -> list[dict]:
    """Spawned rank: this rank's sp_attention output vs the whole-sequence reference, per case and variant.

    layout: SPConfig degrees; variants: AttentionOptions keyword sets (plain, fp8_exchange, overlap).
    Returns per (case, variant) the max |difference| and the reference's scale on this rank.
    """
    from sp_runtime.attention import SeqShards, sp_attention
    from sp_runtime.attention.options import AttentionOptions, using
    from sp_runtime.config import SPConfig
    from sp_runtime.groups import build_groups
    device = torch.device(devices[rank])
    seq = build_groups(SPConfig(["cpu"] * len(devices), **layout)).seq  # the devices only size the layout here
    rows = []
    for index, fields in enumerate(cases):
        case = AttentionCase(**fields)
        q, k, v, text, mask = case.inputs(device, seed=index)
        image_ref, text_ref = reference_attention(q, k, v, text, mask)
        shards = SeqShards.balanced(case.tokens, seq.degree)
        lo, hi = shards.range(seq.rank)
        for variant in variants:
            options = AttentionOptions(**{key: value for key, value in variant.items() if key != "name"})
            with using(options):
                image, text_out = sp_attention(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], seq, shards, text=text,
                                               text_mask=mask)
            difference = float((image.float() - image_ref[:, lo:hi]).abs().max()) if hi > lo else 0.0
            if text is not None:
                difference = max(difference, float((text_out.float() - text_ref).abs().max()))
            scale = max(1.0, float(image_ref.abs().max()))
            rows.append({"case": case.name, "variant": variant["name"], "max_abs_difference": difference,
                         "output_scale": scale})
    return rows


def exchange_sweep(rank: int, devices: list[str], sizes: list[int], repeats: int, head_dim: int = 128
                   ) -> list[dict]:
    """Spawned rank: all_to_all_single of bf16 [world, rows, head_dim] buffers (bytes per rank = size), timed
    plain and through the fp8_exchange option's q/k/v codes (encode + exchange + decode)."""
    import torch.distributed as dist

    from sp_runtime.attention.fp8_exchange import INPUT_CODEC, AllToAll
    from sp_runtime.cli.linkprobe import _timed
    device = torch.device(devices[rank])
    world = len(devices)
    rows = []
    for size in sizes:
        count = max(1, size // 2 // head_dim // world)
        send = torch.randn(world, count, head_dim, device=device).to(torch.bfloat16)
        plain = _timed(lambda: AllToAll(send, None).result(), device, repeats)
        fp8 = _timed(lambda: AllToAll(send, None, INPUT_CODEC).result(), device, repeats)
        rows.append({"bytes": send.numel() * 2, "fp8_bytes": world * count * INPUT_CODEC.row_bytes(head_dim),
                     "plain_seconds": plain, "fp8_seconds": fp8})
    dist.barrier()
    return rows


def fp8_error(device: torch.device, shape: tuple[int, ...], repeats: int = 5) -> dict:
    """fp8_exchange's q/k/v code error on bf16 values like attention inputs (normal, with a few outlier tokens), its
    bytes, and the encode + decode time on `device` (no communication)."""
    from sp_runtime.attention.fp8_exchange import INPUT_CODEC, exchange_bytes
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(shape, generator=generator)
    values.view(-1, shape[-1])[::97] *= 20  # outlier rows: per-row scales keep the others precise
    values = values.to(device, torch.bfloat16)
    roundtrip = INPUT_CODEC.decode(INPUT_CODEC.encode(values), torch.bfloat16)
    error = (roundtrip.float() - values.float()).abs()
    row_scale = values.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
    seconds = median_time(lambda: INPUT_CODEC.decode(INPUT_CODEC.encode(values), torch.bfloat16), repeats,
                          sync=device_sync(device))
    plain = exchange_bytes(shape, torch.bfloat16)
    packed = exchange_bytes(shape, torch.bfloat16, INPUT_CODEC)
    return {"shape": list(shape), "max_error_vs_row_amax": float((error / row_scale).max()),
            "mean_error_vs_row_amax": float((error / row_scale).mean()),
            "bf16_bytes": plain, "fp8_bytes": packed, "bytes_ratio": round(packed / plain, 4),
            "quantize_dequantize_ms": round(seconds * 1e3, 3)}


class RankContext:
    """The CallContext a family gets, for a model run directly in one process (no pool)."""

    def __init__(self, device: torch.device, groups):
        self.device, self.groups = device, groups

    def to_device(self, name, tensor, dtype=None):
        return tensor.to(self.device, dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype)

    def check_cancel(self) -> None:
        pass


def compiled_vs_eager(rank: int, devices: list[str], family: str, config: dict, dtype: str, width: int,
                      height: int, text_tokens: int, steps: int) -> dict:
    """Spawned rank: one random-weight model called eagerly, then with its blocks compiled (torch.compile,
    inductor): warm-up (compilation) apart, median call times, graph breaks, max difference."""
    import torch._dynamo

    from sp_runtime.compile import compile_blocks, graph_breaks
    from sp_runtime.config import SPConfig
    from ..families.synthetic import build_model, family_worker
    from sp_runtime.groups import build_groups
    from .sampling import make_workload, model_timestep
    device = torch.device(devices[rank])
    groups = build_groups(SPConfig(["cpu"] * len(devices)))
    model, dtypes = build_model(family, config, dtype, device, seed=0)
    worker = family_worker(family, model, config, dtypes)
    info = worker.info
    workload = make_workload(family, info.config, info.in_channels, width, height, text_tokens=text_tokens)
    t = model_timestep(family, 0.7, workload.batch)
    context = RankContext(device, groups)
    out = torch.empty(info.output_shape(tuple(workload.noise.shape)))
    sync = device_sync(device)

    def call() -> None:
        with torch.inference_mode():
            worker.forward(workload.noise, t, workload.conditioning, out, context)

    eager_warmup = timings(call, 1, warmups=0, sync=sync)[0]
    eager_times = timings(call, steps, warmups=0, sync=sync)
    eager = out.clone()
    blocks = compile_blocks(model)
    torch._dynamo.utils.counters.clear()
    compile_warmup = timings(call, 1, warmups=0, sync=sync)[0]
    compiled_times = timings(call, steps, warmups=0, sync=sync)
    compiled = out
    scale = max(1.0, float(eager.abs().max()))
    breaks = graph_breaks()
    return {"blocks_compiled": blocks, "graph_breaks": sum(breaks.values()), "graph_break_reasons": breaks,
            "eager_warmup_s": round(eager_warmup, 3),
            "compile_warmup_s": round(compile_warmup, 3),
            "eager_ms": round(statistics.median(eager_times) * 1e3, 3),
            "compiled_ms": round(statistics.median(compiled_times) * 1e3, 3),
            "max_abs_difference": float((compiled.float() - eager.float()).abs().max()), "output_scale": scale,
            "tokens": workload.tokens, "text_tokens": text_tokens}


def tolerance(dtype: str, variant: str) -> float:
    if variant == "fp8_exchange":
        return FP8_TOLERANCE
    return 1e-5 if dtype == "float32" else 2e-2


def worst_by_case(per_rank: list[list[dict]], dtypes: dict[str, str]) -> list[dict]:
    """Merge the ranks' rows: per (case, variant) the largest difference and scale, judged against the tolerance."""
    merged: dict[tuple, dict] = {}
    for rows in per_rank:
        for row in rows:
            key = (row["case"], row["variant"])
            entry = merged.setdefault(key, dict(row))
            for name in ("max_abs_difference", "output_scale"):
                entry[name] = max(entry[name], row[name])
    result = []
    for (case, variant), entry in merged.items():
        limit = tolerance(dtypes[case], variant)
        entry.update(tolerance=limit, ok=entry["max_abs_difference"] <= limit * entry["output_scale"])
        result.append(entry)
    return result

