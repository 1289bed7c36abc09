"""Command line of the lab: `python -m sp_lab {demo,bench,gpu-suite}` (the product's own: `python -m sp_runtime`)."""
from __future__ import annotations

import sys

from sp_runtime.__main__ import main as run_command

COMMANDS = {
    "demo": ("sp_lab.cli.demo", "run a short generation through the pool and check it against one device"),
    "bench": ("sp_lab.cli.bench", "measure step latency, speed-up and memory per layout"),
    "gpu-suite": ("sp_lab.cli.gpu_suite", "measure everything on a CUDA machine within a time budget"),
}


def main(argv: list[str]) -> int:
    return run_command(argv, COMMANDS, prog="python -m sp_lab", description=__doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
