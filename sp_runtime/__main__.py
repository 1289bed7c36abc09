"""Command line: `python -m sp_runtime {demo,bench,doctor,gpu-suite,client}`."""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "demo": ("sp_runtime.cli.demo", "run a short generation through the pool and check it against one device"),
    "bench": ("sp_runtime.cli.bench", "measure step latency, speed-up and memory per layout"),
    "doctor": ("sp_runtime.cli.doctor", "check devices and links, and recommend degrees"),
    "gpu-suite": ("sp_runtime.cli.gpu_suite", "measure everything on a CUDA machine within a time budget"),
    "client": ("sp_runtime.cli.client", "run a ComfyUI API-format workflow on a running ComfyUI server"),
}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m sp_runtime", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (module_name, help_text) in COMMANDS.items():
        modules[name] = importlib.import_module(module_name)
        modules[name].add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    return modules[args.command].run(args) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
