"""SPRandomConditioning, "Random Conditioning (Ulysses SP, no text encoder)": seeded random text conditioning of any
width, for the two runs a user makes without a text encoder: checking an install on the CPU with the tiny example model
(example_workflows/tiny_qwen_image_cpu.json, nothing downloaded) and timing a big model's denoising alone."""
from __future__ import annotations

import torch
from comfy_api.latest import io

from .loader import CATEGORY


def random_conditioning(width: int, tokens: int, seed: int, pooled_width: int = 0, guidance: float = -1.0,
                        batch: int = 1) -> list:
    """CONDITIONING as a text encoder gives it: [[text [B, tokens, width], extras]]; text is drawn first, then
    the pooled vector (Flux's `y`), from one generator seeded with `seed`."""
    generator = torch.Generator().manual_seed(seed)
    text = torch.randn(batch, tokens, width, generator=generator)
    extras = {}
    if pooled_width > 0:
        extras["pooled_output"] = torch.randn(batch, pooled_width, generator=generator)
    if guidance >= 0:
        extras["guidance"] = guidance
    return [[text, extras]]


class SPRandomConditioning(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SPRandomConditioning",
            display_name="Random Conditioning (Ulysses SP, no text encoder)",
            category=f"{CATEGORY}/testing",
            description="Seeded random conditioning in place of a text encoder: to check an install with the tiny "
                        "example model, or to time a model's denoising without loading its text encoder. Not for "
                        "real images.",
            inputs=[
                io.Int.Input("width", default=32, min=1, max=16384, tooltip="Text feature width of the model "
                             "(Qwen-Image 3584, Flux 4096, Wan 4096; the tiny test models 32)."),
                io.Int.Input("tokens", default=7, min=1, max=4096),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFF, control_after_generate=True),
                io.Int.Input("pooled_width", default=0, min=0, max=16384,
                             tooltip="Flux's pooled CLIP vector width (768; tiny test models 24); 0 = none."),
                io.Float.Input("guidance", default=-1.0, min=-1.0, max=100.0, step=0.1,
                               tooltip="Flux guidance; -1 = none."),
            ],
            outputs=[io.Conditioning.Output()],
        )

    @classmethod
    def execute(cls, width, tokens, seed, pooled_width, guidance) -> io.NodeOutput:
        return io.NodeOutput(random_conditioning(width, tokens, seed, pooled_width, guidance))
