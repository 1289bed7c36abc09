"""Per-rank activation memory of the sequence-parallel LTX-2 (audio + video) forward at Ulysses degree 1, 2, 4.

A small random-weight LTX-2 (video 4 heads of 128, audio 4 heads of 64, two blocks, the tiny text connectors) runs
one call on a video latent plus its audio latent through the worker pool at each degree; rank_memory.py says how
activation memory is measured. Video tokens are split, audio tokens replicated, so the video part shrinks with the
degree and the audio part does not.

    python benchmarks/bench_ltx2_memory.py                # CPU, writes benchmarks/results/ltx2_memory_cpu.json
    python benchmarks/bench_ltx2_memory.py --device cuda  # GPUs 0..3, writes ltx2_memory_cuda.json

Times in the output are for orientation only: measure them on a quiet machine.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch

from rank_memory import ROOT, measure, with_fractions
from sp_runtime.cli.machine import describe_machine, write_json
from sp_runtime.families import ltx2
from sp_lab.tiny_models import write_tiny_checkpoint
from sp_lab.tiny_models.ltx2 import LTX2_TINY

MODEL = dict(num_attention_heads=4, attention_head_dim=128, cross_attention_dim=512, audio_num_attention_heads=4,
             audio_attention_head_dim=64, audio_cross_attention_dim=256)
TEXT_TOKENS = 64


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--shape", type=int, nargs=3, default=[9, 16, 24], metavar=("F", "H", "W"),
                        help="video latent frames, height, width (default 9 x 16 x 24: 3456 video tokens)")
    parser.add_argument("--audio-tokens", type=int, default=76, help="audio latent frames (76: about 3 s)")
    parser.add_argument("--output", default=None)
    return parser.parse_args()


def call_inputs(shape, audio_tokens: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    video = torch.randn(1, 128, *shape, generator=generator)
    audio = torch.randn(1, 8, audio_tokens, 16, generator=generator)
    context = torch.randn(1, TEXT_TOKENS, LTX2_TINY["caption_channels"], generator=generator)
    return ltx2.pack_comfy_call([video, audio], (torch.tensor([0.7]), torch.tensor([0.7])), {"context": context})


def main() -> None:
    args = parse_args()
    output = args.output or os.path.join(ROOT, "benchmarks", "results", f"ltx2_memory_{args.device}.json")
    x, timestep, inputs = call_inputs(args.shape, args.audio_tokens)
    with tempfile.TemporaryDirectory(prefix="bench_ltx2_") as folder:
        path = write_tiny_checkpoint("ltx2", os.path.join(folder, "ltx2_small.safetensors"), **MODEL)
        results = []
        for degree in args.degrees:
            result = measure(path, degree, args.device, lambda handle: handle(x, timestep, **inputs))
            print(f"degree {degree}: activation per rank max {result['max_activation_mib']:.1f} MiB, "
                  f"mean {result['mean_activation_mib']:.1f} MiB, call {result['call_s']:.2f} s", flush=True)
            results.append(result)
    report = {
        "what": "per-rank activation memory of one LTX-2 forward (peak during the call minus memory held before)",
        "model": {**MODEL, "num_layers": 2, "dtype": "float32"},
        "latent": {"batch": 1, "frames": args.shape[0], "height": args.shape[1], "width": args.shape[2],
                   "video_tokens": args.shape[0] * args.shape[1] * args.shape[2], "audio_tokens": args.audio_tokens,
                   "text_tokens": TEXT_TOKENS},
        "device": args.device, "machine": describe_machine(), "results": with_fractions(results),
        "note": "call_s was measured on a shared machine; re-measure timings on a quiet one",
    }
    write_json(output, report, say=True)


if __name__ == "__main__":
    main()
