"""The speed model: predicted time of one denoising step per layout (Ulysses, Ring, hybrid, CFG, tensor parallel,
shard_weights) on
P devices, from the model's shape, the device's achieved throughput and the link bandwidth; and the memory each
layout needs per device.

Compute of one rank = its image tokens through every token-local layer (2 FLOPs per weight on the token's path; joint
text is replicated, so every rank runs all of it) + its share of the attention (4 x S^2 x D per head: its H/U heads,
padded to the Ulysses degree U, over the whole sequence, split again by the Ring degree); CFG groups split the batch.
Exchanges are sp_runtime.cli.comm's, at the link: every all-to-all sends (P-1)/P of its buffer (DeepSpeed-Ulysses'
4 N h / P per layer for q, k, v and the output) at the per-direction bandwidth plus a latency per call; ring shifts
overlap the attention and shard_weights' gathers the next block's compute (only what exceeds it shows). Tensor
parallelism (T) divides the block weights, their FLOPs and the heads by T (weights held ~1/T) and adds two
all-reduces of tokens x width per block, on the critical path.
Rank emulation (benchmarks/rank_emulation.py) measures a rank's compute on one device; `compute_s` replaces the
FLOP estimate with it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..config import SPConfig
from .comm import AttentionShape, step_exchanges

# diffusers' HunyuanVideoTransformer3DModel defaults: the 13B release
HUNYUAN_VIDEO_13B = dict(num_attention_heads=24, attention_head_dim=128, num_layers=20, num_single_layers=40)
WORTH_IT = 1.05  # a layout on more devices (or sharded) must beat the smaller / plainer one by 5% to be chosen


@dataclass(frozen=True)
class ModelShape:
    """What the step time depends on: attention layers and heads, weights on an image / text token's path
    (FLOPs per token = 2 x those), all weights (memory), blocks (shard_weights' gathers), and whether the model
    runs CFG (batch 2 per call) and joins text to its attention."""

    name: str
    family: str
    layers: int
    heads: int
    head_dim: int
    image_weights: int
    text_weights: int
    parameters: int
    blocks: int
    joint_text: bool = True
    cfg: bool = False

    @property
    def attention(self) -> AttentionShape:
        return AttentionShape(self.family, self.layers, self.heads, self.head_dim, self.joint_text)


def shape_of(name: str, family: str, model, cfg: bool = False) -> ModelShape:
    """Count a (meta) diffusers model's token-path weights: block Linear layers, minus the AdaLN modulation (it acts
    on the timestep, once per sample); text-stream layers (add_*, *context*, txt_*, cross-attention k/v) go to the
    text tokens, the rest to the image tokens."""
    import torch
    image = text = 0
    blocks = 0
    for block_list in ("transformer_blocks", "single_transformer_blocks", "blocks"):
        for block in getattr(model, block_list, []) or []:
            blocks += 1
            for module_name, module in block.named_modules():
                if not isinstance(module, torch.nn.Linear) or _is_modulation(module_name):
                    continue
                if _is_text_stream(module_name):
                    text += module.weight.numel()
                else:
                    image += module.weight.numel()
    single = len(getattr(model, "single_transformer_blocks", []) or [])
    config = model.config
    heads = config.num_attention_heads
    if single:  # single-stream blocks run text tokens through the same weights as image tokens
        per_single = sum(m.weight.numel() for n, m in model.single_transformer_blocks[0].named_modules()
                         if isinstance(m, torch.nn.Linear) and not _is_modulation(n))
        text += single * per_single
    layers = blocks
    return ModelShape(name, family, layers, heads, config.attention_head_dim, image, text,
                      sum(p.numel() for p in model.parameters()), blocks, joint_text=family != "wan", cfg=cfg)


def _is_modulation(name: str) -> bool:
    return (name.startswith("norm") and name.endswith("linear")) or "_mod" in name


def _is_text_stream(name: str) -> bool:
    return any(part in name for part in ("add_", "context", "txt_", "attn2.to_k", "attn2.to_v"))


def known_shape(model: str) -> ModelShape:
    """Shapes of the models the doctor knows: qwen-image, flux, wan, hunyuan-video (counted on meta models)."""
    from accelerate import init_empty_weights
    from diffusers import HunyuanVideoTransformer3DModel

    from .model_shapes import DOCTOR_MODELS, FULL_SIZE, empty_model
    if model == "hunyuan-video":
        with init_empty_weights():
            return shape_of(model, "hunyuan_video", HunyuanVideoTransformer3DModel(**HUNYUAN_VIDEO_13B))
    preset = FULL_SIZE[DOCTOR_MODELS[model]]
    built = empty_model(preset.family, preset.size)
    return shape_of(model, preset.family, built, cfg=preset.family in ("qwen_image", "wan"))


def video_tokens(width: int, height: int, frames: int) -> int:
    """Tokens of a 4x-temporal, 8x-spatial VAE latent in 1x2x2 patches (Wan, HunyuanVideo)."""
    return (1 + (frames - 1) // 4) * (height // 16) * (width // 16)


@dataclass
class Throughput:
    """Achieved FLOP/s of attention and of large matmuls, measured on one device (or stated)."""

    device: str
    dtype: str
    attention_flops_per_s: float
    matmul_flops_per_s: float


def measure_throughput(device: str, heads: int, head_dim: int, repeats: int = 3) -> Throughput:
    """Achieved FLOP/s of SDPA and of a square-ish matmul on one device (bf16 on GPUs, fp32 on CPUs)."""
    import torch

    from .machine import device_sync, median_time
    target = torch.device(device)
    dtype = torch.bfloat16 if target.type == "cuda" else torch.float32
    tokens, probe_heads = (8192, heads) if target.type == "cuda" else (1024, min(heads, 8))
    width = heads * head_dim
    q, k, v = (torch.randn(1, probe_heads, tokens, head_dim, device=target, dtype=dtype) for _ in range(3))
    a = torch.randn(tokens, width, device=target, dtype=dtype)
    b = torch.randn(width, width, device=target, dtype=dtype)
    with torch.inference_mode():
        attention_s = median_time(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), repeats,
                                  sync=device_sync(target))
        matmul_s = median_time(lambda: a @ b, repeats, sync=device_sync(target))
    return Throughput(device, str(dtype).removeprefix("torch."),
                      4 * tokens * tokens * probe_heads * head_dim / attention_s, 2 * tokens * width * width / matmul_s)


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


@dataclass(frozen=True)
class Device:
    """Achieved throughput of one device (FLOP/s of large matmuls and of attention) and its memory."""

    name: str
    matmul_flops: float
    attention_flops: float
    memory_bytes: Optional[float] = None
    shared_cores: bool = False  # CPU workers: every rank runs on the same cores, so a rank's share does not shrink


@dataclass(frozen=True)
class Link:
    """Per-direction bandwidth of one device's links (bytes/s) and a fixed latency per collective call; or a
    measured all-to-all sweep (doctor's rows: bytes per rank -> seconds), which wins when given."""

    bandwidth: float
    latency_s: float = 20e-6
    sweep: Optional[Sequence[dict]] = None

    def all_to_all_seconds(self, buffer_bytes: float, sent_bytes: float) -> float:
        if self.sweep:
            return transfer_seconds(buffer_bytes, self.sweep)
        return self.latency_s + sent_bytes / self.bandwidth

    def send_seconds(self, sent_bytes: float) -> float:
        return self.latency_s + sent_bytes / self.bandwidth


@dataclass(frozen=True)
class Layout:
    ulysses: int = 1
    ring: int = 1
    cfg: int = 1
    shard_weights: bool = False
    tp: int = 1

    @property
    def devices(self) -> int:
        return self.ulysses * self.ring * self.cfg * self.tp

    @property
    def name(self) -> str:
        parts = [f"{axis}{degree}" for axis, degree in (("u", self.ulysses), ("r", self.ring), ("cfg", self.cfg),
                                                        ("tp", self.tp)) if degree > 1]
        return ("".join(parts) or "1") + ("+shard_weights" if self.shard_weights else "")


@dataclass
class Prediction:
    layout: str
    devices: int
    compute_s: float
    exchange_s: float
    step_s: float
    bytes_sent: int
    memory_bytes: float
    fits: Optional[bool]
    speedup: float = 1.0
    parts: dict = field(default_factory=dict)


def layouts(devices: int, cfg: bool, heads: int = 0) -> list[Layout]:
    """Every layout on 1, 2, 4, ... up to `devices` (and `devices` itself): Ulysses x Ring x CFG (CFG only for a
    model that runs CFG), each also with shard_weights on more than one device; and with a tensor-parallel degree
    that divides `heads` (0: none), TP innermost (not with shard_weights: both split the weights)."""
    counts = sorted({2 ** k for k in range(int(math.log2(devices)) + 1)} | {devices})
    found = []
    for count in counts:
        for cfg_degree in ((1, 2) if cfg and count % 2 == 0 else (1,)):
            for tp in _divisors(count // cfg_degree):
                if tp > 1 and (not heads or heads % tp):
                    continue
                rest = count // cfg_degree // tp
                for ring in _divisors(rest):
                    for shard in ((False, True) if count > 1 and tp == 1 else (False,)):
                        found.append(Layout(rest // ring, ring, cfg_degree, shard, tp))
    return found


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def predict(shape: ModelShape, tokens: int, text: int, layout: Layout, device: Device, link: Link,
            element_bytes: int = 2, compute_s: Optional[float] = None) -> Prediction:
    """One step's predicted time on the busiest rank of `layout` (compute_s: a measured rank's compute instead of
    the FLOP estimate)."""
    batch = 2 if shape.cfg else 1
    group_batch = batch // layout.cfg if batch % layout.cfg == 0 else batch
    sequence = layout.ulysses * layout.ring
    joint = tokens + (text if shape.joint_text else 0)
    padded_heads = -(-shape.heads // layout.tp // layout.ulysses) * layout.ulysses
    local_tokens = -(-tokens // sequence)
    linear_flops = 2 * group_batch * (local_tokens * shape.image_weights + text * shape.text_weights) / layout.tp
    attention_flops = 4 * group_batch * shape.layers * shape.head_dim * padded_heads * joint * joint / sequence
    if not shape.joint_text:  # Wan: cross-attention of the video tokens to the text
        attention_flops += 4 * group_batch * shape.layers * shape.head_dim * padded_heads * local_tokens * text \
            / layout.ulysses
    linear_s = linear_flops / device.matmul_flops
    attention_s = attention_flops / device.attention_flops
    if compute_s is None:
        compute_s = (linear_s + attention_s) * (layout.devices if device.shared_cores else 1)
    config = SPConfig(["cpu"] * layout.devices, ulysses_degree=layout.ulysses, ring_degree=layout.ring,
                      cfg_degree=layout.cfg, tensor_parallel_degree=layout.tp)
    exchange_s, sent, ring_s, reduce_s = 0.0, 0, 0.0, 0.0
    for exchange in step_exchanges(shape.attention, config, tokens, text, batch):
        buffer = exchange.elements * element_bytes
        moved = exchange.bytes_sent(element_bytes)
        sent += moved
        if exchange.kind == "all_to_all":
            exchange_s += exchange.calls * link.all_to_all_seconds(buffer, buffer * exchange.sent_fraction)
        elif exchange.kind == "all_reduce":  # waits for the block's output: nothing to hide it behind
            reduce_s += exchange.calls * link.send_seconds(buffer * exchange.sent_fraction)
        else:
            ring_s += exchange.calls * link.send_seconds(buffer * exchange.sent_fraction)
    hidden_ring = max(0.0, ring_s - attention_s)  # the ring's shifts run while the previous block attends
    weights = shape.parameters * element_bytes
    gather_s = 0.0
    if layout.shard_weights:
        moved = weights * (layout.devices - 1) / layout.devices
        sent += int(moved)
        gather_s = max(0.0, shape.blocks * link.send_seconds(moved / shape.blocks) - compute_s)
    step = compute_s + exchange_s + hidden_ring + gather_s + reduce_s
    memory = _memory(shape, layout, weights, local_tokens, joint, text, group_batch, element_bytes)
    fits = None if device.memory_bytes is None else memory <= 0.9 * device.memory_bytes
    return Prediction(layout.name, layout.devices, compute_s, exchange_s + hidden_ring + gather_s + reduce_s, step,
                      sent, memory, fits,
                      parts={"linear_s": linear_s, "attention_s": attention_s, "all_to_all_s": exchange_s,
                             "ring_shift_s": ring_s, "ring_shown_s": hidden_ring, "weight_gather_s": gather_s,
                             "tp_all_reduce_s": reduce_s})


def _memory(shape: ModelShape, layout: Layout, weights: float, local_tokens: int, joint: int, text: int,
            group_batch: int, element_bytes: int) -> float:
    """Weights held (all, or 1/P + two gathered blocks with shard_weights) + a block's activations: ~12 values of
    the width per local token (residual, norms, MLP's 4x hidden), q / k / v and output of this rank's heads over the
    whole sequence (Ulysses' received buffer)."""
    held = weights / layout.devices + 2 * weights / shape.blocks if layout.shard_weights else weights / layout.tp
    width = shape.heads * shape.head_dim
    heads_here = -(-shape.heads // layout.tp // layout.ulysses)
    activations = group_batch * element_bytes * ((local_tokens + text) * width * 12
                                                 + 4 * joint * heads_here * shape.head_dim // layout.ring)
    return held + activations


def plan(shape: ModelShape, tokens: int, text: int, devices: int, device: Device, link: Link,
         element_bytes: int = 2) -> dict:
    """Predictions for every layout on up to `devices`, fastest first, and the recommended one: the fastest that
    fits in memory, unless fewer devices or no sharding comes within WORTH_IT of it."""
    rows = [predict(shape, tokens, text, layout, device, link, element_bytes)
            for layout in layouts(devices, shape.cfg, shape.heads)]
    one = next(row for row in rows if row.devices == 1)
    for row in rows:
        row.speedup = one.step_s / row.step_s
    rows.sort(key=lambda row: row.step_s)
    fitting = [row for row in rows if row.fits is not False]
    best = None
    if fitting:
        fastest = fitting[0].step_s
        near = [row for row in fitting if row.step_s <= fastest * WORTH_IT]
        best = min(near, key=lambda row: (row.devices, "shard" in row.layout, "tp" in row.layout, row.step_s))
    return {"rows": rows, "recommended": best}


def format_table(result: dict) -> list[str]:
    """The plan as printed lines: layout, devices, step time (compute + exchanges), speed-up, memory."""
    lines = [f"  {'layout':<22} {'devices':>7} {'step ms':>10} {'compute':>10} {'exchange':>10} {'speed-up':>8} "
             f"{'memory GB':>10}"]
    for row in result["rows"]:
        fits = "" if row.fits is None else ("" if row.fits else "  does not fit")
        lines.append(f"  {row.layout:<22} {row.devices:>7} {row.step_s * 1e3:>10.1f} {row.compute_s * 1e3:>10.1f} "
                     f"{row.exchange_s * 1e3:>10.1f} {row.speedup:>7.2f}x {row.memory_bytes / 1e9:>10.1f}{fits}")
    best = result["recommended"]
    lines.append(f"  predicted fastest that fits: {best.layout} ({best.step_s * 1e3:.1f} ms/step, "
                 f"{best.speedup:.2f}x)" if best else "  no layout fits in memory")
    return lines
