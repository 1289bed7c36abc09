"""Per-rank activation memory of the sequence-parallel video forwards (Wan, HunyuanVideo 1.0 / 1.5) at Ulysses
degree 1, 2, 4.

A small-but-not-tiny random-weight model (4 heads of 128, the real text widths, 512 text tokens for Wan, 256 for
HunyuanVideo) runs one call on a video latent through the worker pool at each degree; rank_memory.py says how
activation memory is measured.

    python benchmarks/bench_wan_memory.py                      # CPU, writes benchmarks/results/wan_memory_cpu.json
    python benchmarks/bench_wan_memory.py --device cuda        # GPUs 0..3, writes wan_memory_cuda.json
    python benchmarks/bench_wan_memory.py --family hunyuan_video15   # writes hunyuan_video15_memory_cpu.json

Times in the output are for orientation only: measure them on a quiet machine.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch

from rank_memory import ROOT, measure, with_fractions
from sp_runtime.cli.machine import describe_machine, write_json
from sp_lab.tiny_models import write_tiny_checkpoint

HEADS = dict(num_attention_heads=4, attention_head_dim=128)
MODELS = {"wan": dict(HEADS, ffn_dim=2048, num_layers=2, text_dim=4096),
          "hunyuan_video": dict(HEADS, text_embed_dim=4096, pooled_projection_dim=768),
          "hunyuan_video15": dict(HEADS, text_embed_dim=3584)}
TEXT_TOKENS = {"wan": 512, "hunyuan_video": 256, "hunyuan_video15": 256}
DEFAULT_SHAPES = {"wan": [9, 40, 64], "hunyuan_video": [9, 40, 64], "hunyuan_video15": [9, 20, 32]}  # 5760 tokens


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--family", default="wan", choices=sorted(MODELS))
    parser.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--shape", type=int, nargs=3, default=None, metavar=("T", "H", "W"),
                        help="latent frames, height, width (default: 5760 video tokens, 9 x 40 x 64 for patch 2)")
    parser.add_argument("--variant", default="t2v", choices=("t2v", "ti2v"),
                        help="Wan ti2v: 48 channels with per-frame timesteps (per-token modulation)")
    parser.add_argument("--output", default=None)
    return parser.parse_args()


def call_inputs(family: str, variant: str, shape, seed: int = 0):
    """(x, timestep, kwargs) of one ComfyUI call of the family."""
    generator = torch.Generator().manual_seed(seed)
    channels = {"hunyuan_video15": 65}.get(family, 48 if variant == "ti2v" else 16)
    frames = shape[0]
    x = torch.randn(1, channels, *shape, generator=generator)
    timestep = torch.tensor([[0.0] + [700.0] * (frames - 1)]) if variant == "ti2v" else torch.tensor([700.0])
    model = MODELS[family]
    context = torch.randn(1, TEXT_TOKENS[family], model.get("text_dim") or model["text_embed_dim"],
                          generator=generator)
    if family == "hunyuan_video":
        return x, timestep, {"context": context, "y": torch.randn(1, 768, generator=generator),
                             "guidance": torch.tensor([6.0])}
    return x, timestep, {"context": context}


def main() -> None:
    args = parse_args()
    family, shape = args.family, args.shape or DEFAULT_SHAPES[args.family]
    patch = 1 if family == "hunyuan_video15" else 2
    tokens = shape[0] * (-(-shape[1] // patch)) * (-(-shape[2] // patch))
    output = args.output or os.path.join(ROOT, "benchmarks", "results", f"{family}_memory_{args.device}.json")
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as folder:
        variant = {"variant": args.variant} if family == "wan" else {}
        path = write_tiny_checkpoint(family, os.path.join(folder, f"{family}_small.safetensors"), **variant,
                                     **MODELS[family])
        results = []
        for degree in args.degrees:
            x, timestep, inputs = call_inputs(family, args.variant, shape)
            result = measure(path, degree, args.device, lambda handle: handle(x, timestep, **inputs))
            print(f"degree {degree}: activation per rank max {result['max_activation_mib']:.1f} MiB, "
                  f"mean {result['mean_activation_mib']:.1f} MiB, call {result['call_s']:.2f} s", flush=True)
            results.append(result)
    with_fractions(results)
    report = {
        "what": f"per-rank activation memory of one {family} forward (peak during the call minus memory held "
                f"before)",
        "model": {**MODELS[family], "family": family, "variant": args.variant if family == "wan" else "t2v",
                  "dim": HEADS["num_attention_heads"] * HEADS["attention_head_dim"], "dtype": "float32"},
        "latent": {"batch": 1, "frames": shape[0], "height": shape[1], "width": shape[2],
                   "video_tokens": tokens, "text_tokens": TEXT_TOKENS[family]},
        "device": args.device, "machine": describe_machine(), "results": results,
        "note": "call_s was measured on a shared machine; re-measure timings on a quiet one",
    }
    write_json(output, report, say=True)


if __name__ == "__main__":
    main()
