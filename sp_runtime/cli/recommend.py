"""The doctor's degree recommendation: estimated step time per Ulysses degree for a model and resolution, from the
measured device throughput (attention and matmul) and the measured all-to-all bandwidth, with the reasons.

Model: compute = attention FLOPs / attention rate + 2 x tokens x parameters / matmul rate; GPUs split it by the
degree (attention by the padded head count), CPU workers share the same cores so it does not shrink; the exchanges
of sp_runtime.cli.comm are added at the measured bandwidth for their message size, not overlapped. It is an
estimate for choosing a degree; `python -m sp_lab bench` measures the real thing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..config import SPConfig
from .comm import DTYPE_BYTES, AttentionShape, step_exchanges
from .machine import device_sync, median_time
from .model_shapes import FULL_SIZE, count_parameters, latent_shape, token_count

MODELS = {"qwen-image": "qwen-image-20b", "flux": "flux-12b", "wan": "wan-14b"}
MIN_TOKENS_PER_RANK = 1024   # below this a GPU's kernels run mostly idle and fixed costs dominate
WORTH_IT = 1.05               # a larger degree must beat a smaller one by 5% to be recommended


@dataclass
class Throughput:
    device: str
    dtype: str
    attention_flops_per_s: float
    matmul_flops_per_s: float


def measure_throughput(device: str, heads: int, head_dim: int, repeats: int = 3) -> Throughput:
    """Achieved FLOP/s of SDPA and of a square-ish matmul on one device (bf16 on GPUs, fp32 on CPUs)."""
    target = torch.device(device)
    dtype = torch.bfloat16 if target.type == "cuda" else torch.float32
    tokens, probe_heads = (8192, heads) if target.type == "cuda" else (1024, min(heads, 8))
    width = heads * head_dim
    q, k, v = (torch.randn(1, probe_heads, tokens, head_dim, device=target, dtype=dtype) for _ in range(3))
    a = torch.randn(tokens, width, device=target, dtype=dtype)
    b = torch.randn(width, width, device=target, dtype=dtype)
    attention_s = _median_seconds(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), target, repeats)
    matmul_s = _median_seconds(lambda: a @ b, target, repeats)
    return Throughput(device, str(dtype).removeprefix("torch."),
                      4 * tokens * tokens * probe_heads * head_dim / attention_s, 2 * tokens * width * width / matmul_s)


def _median_seconds(fn, device: torch.device, repeats: int) -> float:
    with torch.inference_mode():
        return median_time(fn, repeats, sync=device_sync(device))


def transfer_seconds(message_bytes: float, sweep: Sequence[dict]) -> float:
    """Time of one all-to-all of message_bytes per rank, interpolated (log-log) in the measured sweep."""
    points = sorted((row["bytes"], row["seconds"]) for row in sweep)
    if message_bytes <= points[0][0]:
        return points[0][1]
    if message_bytes >= points[-1][0]:  # beyond the sweep: the largest message's bandwidth
        return points[-1][1] * message_bytes / points[-1][0]
    for (b0, t0), (b1, t1) in zip(points, points[1:]):
        if b0 <= message_bytes <= b1:
            weight = math.log(message_bytes / b0) / math.log(b1 / b0)
            return math.exp(math.log(t0) + weight * (math.log(t1) - math.log(t0)))
    return points[-1][1]


def recommend(model: str, width: int, height: int, frames: int, text_tokens: Optional[int], devices: list[str],
              sweep: Optional[Sequence[dict]], throughput: Throughput, memory_bytes: Optional[int]) -> dict:
    """Estimated step time per degree and the recommended degree, with the reasons."""
    preset = FULL_SIZE[MODELS[model]]
    config = preset.size
    shape = AttentionShape.of(preset.family, config)
    text = text_tokens or preset.text_tokens
    tokens = token_count(preset.family, latent_shape(preset.family, 16, width, height, frames))
    parameters = count_parameters(preset.family, config)
    dtype = "bfloat16"
    joint = tokens + (text if shape.joint_text else 0)
    attention_flops = shape.layers * 4 * shape.heads * shape.head_dim * joint * joint
    if not shape.joint_text:  # Wan: cross-attention of the video tokens to the text, no communication
        attention_flops += shape.layers * 4 * shape.heads * shape.head_dim * tokens * text
    attention_s = attention_flops / throughput.attention_flops_per_s
    linear_s = 2 * joint * parameters / throughput.matmul_flops_per_s
    shared_cores = not devices[0].startswith("cuda")
    candidates = []
    for degree in _degrees(len(devices)):
        candidates.append(_candidate(degree, shape, tokens, text, devices, sweep, attention_s, linear_s,
                                     shared_cores, dtype))
    best = _choose(candidates)
    weights = parameters * DTYPE_BYTES[dtype]
    reasons = [_verdict(best, candidates)] + list(best["reasons"])
    sharding = shard_weights_estimate(weights, shape.layers, len(devices), sweep, best["compute_ms"] / 1e3)
    if memory_bytes is not None and weights > 0.9 * memory_bytes:
        fits = sharding is not None and sharding["weights_per_device_bytes"] <= 0.9 * memory_bytes
        reasons.append(f"the {weights / 1e9:.1f} GB of bf16 weights do not fit in {memory_bytes / 1e9:.1f} GB per "
                       f"device (every rank holds all weights): " + (
                           f"load with shard_weights ({sharding['weights_per_device_bytes'] / 1e9:.1f} GB per "
                           f"device), or fp8 weights ({weights / 2e9:.1f} GB)" if fits else
                           f"load fp8 weights ({weights / 2e9:.1f} GB) or use larger GPUs"))
    if sharding is not None:
        reasons.append(sharding["advice"])
    if shared_cores:
        reasons.append("CPU workers share the same cores: sequence parallelism adds no compute on a CPU-only "
                       "machine (use it for correctness checks); on GPUs each rank brings its own")
    return {"model": model, "preset": preset.name, "width": width, "height": height,
            "frames": frames if preset.is_video else None, "image_tokens": tokens, "text_tokens": text,
            "heads": shape.heads, "head_dim": shape.head_dim, "attention_layers": shape.layers,
            "parameters": parameters, "weights_gb_bf16": round(weights / 1e9, 2),
            "estimated_one_device_ms": round((attention_s + linear_s) * 1e3, 1), "throughput": throughput.__dict__,
            "candidates": candidates, "recommended_layout": best["layout"], "shard_weights": sharding,
            "reasons": reasons,
            "note": "estimate from measured throughput and link speed; measure with `python -m sp_lab bench`"}


def shard_weights_estimate(weights: int, blocks: int, ranks: int, sweep: Optional[Sequence[dict]],
                           compute_s: float) -> Optional[dict]:
    """What load option shard_weights would cost on `ranks` devices: weights per device (1/N of the blocks plus two
    gathered blocks; the few non-block weights counted as blocks), bytes each device receives per step ((N-1)/N of
    all blocks), and that traffic's time at the measured link speed (one all-to-all-sized transfer per block; the
    next block's gather overlaps the current block's compute, so only what exceeds the compute shows)."""
    if ranks < 2:
        return None
    block = weights / max(1, blocks)
    moved = weights * (ranks - 1) / ranks
    gather_s = blocks * transfer_seconds(block, sweep) if sweep else None
    result = {"weights_per_device_bytes": int(weights / ranks + 2 * block), "bytes_moved_per_step": int(moved),
              "gather_ms": None if gather_s is None else round(gather_s * 1e3, 1)}
    shown = "link speed not measured" if gather_s is None else (
        f"~{gather_s * 1e3:.0f} ms of gathers per step at the measured link speed against {compute_s * 1e3:.0f} ms "
        f"of compute (overlapped: " + ("hidden" if gather_s <= compute_s else
                                       f"adds ~{(gather_s - compute_s) * 1e3:.0f} ms") + ")")
    result["advice"] = (f"shard_weights on {ranks} devices: {result['weights_per_device_bytes'] / 1e9:.1f} GB of "
                        f"weights per device instead of {weights / 1e9:.1f}; each step moves "
                        f"{moved / 1e9:.1f} GB to every device, {shown}; use it when the model does not fit")
    return result


def _verdict(best: dict, candidates: list[dict]) -> str:
    if best["degree"] > 1:
        return (f"estimated {best['estimated_speedup']:.2f}x faster than one device ({best['estimated_ms']:.1f} vs "
                f"{candidates[0]['estimated_ms']:.1f} ms per step)")
    if len(candidates) == 1:
        return "one device: nothing to split over"
    fastest = max(candidates[1:], key=lambda c: c["estimated_speedup"])
    return (f"no larger degree is estimated to be at least {WORTH_IT - 1:.0%} faster than one device (best: "
            f"{fastest['layout']} at {fastest['estimated_speedup']:.2f}x)")


def _degrees(count: int) -> list[int]:
    degrees = [1]
    while degrees[-1] * 2 <= count:
        degrees.append(degrees[-1] * 2)
    if count not in degrees:
        degrees.append(count)
    return degrees


def _candidate(degree: int, shape: AttentionShape, tokens: int, text: int, devices: list[str],
               sweep: Optional[Sequence[dict]], attention_s: float, linear_s: float, shared_cores: bool,
               dtype: str) -> dict:
    padded = -(-shape.heads // degree) * degree
    padding = padded / shape.heads
    split = 1 if shared_cores else degree
    compute_s = (attention_s * padding + linear_s) / split
    config = SPConfig(["cpu"] * degree if shared_cores else devices[:degree], ulysses_degree=degree)
    exchanges = step_exchanges(shape, config, tokens, text, batch=1)
    comm_s = None
    if degree == 1:
        comm_s = 0.0
    elif sweep:
        comm_s = sum(transfer_seconds(e.elements * DTYPE_BYTES[dtype], sweep) * e.calls for e in exchanges)
    total = compute_s + (comm_s or 0.0)
    per_rank = -(-tokens // degree)
    reasons = []
    if degree > 1:
        reasons.append(f"{shape.heads} heads on {degree} ranks: " + (
            "divisible, no padding" if padded == shape.heads else
            f"padded to {padded}, {padding - 1:.0%} extra attention work"))
        reasons.append(f"{tokens} image tokens -> {per_rank} per rank" + (
            "" if per_rank >= MIN_TOKENS_PER_RANK or shared_cores else
            f" (below {MIN_TOKENS_PER_RANK}: GPU kernels run mostly idle, fixed costs dominate)"))
        if comm_s is not None:
            moved = sum(e.bytes_sent(DTYPE_BYTES[dtype]) for e in exchanges)
            reasons.append(f"all-to-all {moved / 2**20:.0f} MiB per step per rank at the measured link speed: "
                           f"{comm_s * 1e3:.1f} ms vs {compute_s * 1e3:.1f} ms of compute per rank")
        else:
            reasons.append("link speed not measured: communication not included")
    return {"layout": f"u{degree}" if degree > 1 else "1", "degree": degree, "head_padding": round(padding, 4),
            "tokens_per_rank": per_rank, "compute_ms": round(compute_s * 1e3, 2),
            "comm_ms": None if comm_s is None else round(comm_s * 1e3, 2), "estimated_ms": round(total * 1e3, 2),
            "reasons": reasons}


def _choose(candidates: list[dict]) -> dict:
    """The smallest degree within WORTH_IT of the fastest estimate (extra devices must pay for themselves)."""
    fastest = min(c["estimated_ms"] for c in candidates)
    for candidate in sorted(candidates, key=lambda c: c["degree"]):
        if candidate["estimated_ms"] <= fastest * WORTH_IT:
            one = candidates[0]["estimated_ms"]
            for c in candidates:
                c["estimated_speedup"] = round(one / c["estimated_ms"], 3)
            return candidate
    return candidates[0]
