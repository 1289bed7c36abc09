"""Command line: `python -m sp_runtime {doctor,client,join}` (the demo, bench and GPU suite: `python -m sp_lab`)."""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "doctor": ("sp_runtime.cli.doctor", "check devices and links, and recommend degrees"),
    "client": ("sp_runtime.cli.client", "run a ComfyUI API-format workflow on a running ComfyUI server"),
    "join": ("sp_runtime.cli.join", "give this machine's devices to a host's pool (docs/MULTI_MACHINE.md)"),
}
LAB_COMMANDS = ("demo", "bench", "gpu-suite")  # moved to the lab package beside the product


def main(argv: list[str], commands: dict = COMMANDS, prog: str = "python -m sp_runtime",
         description: str = __doc__) -> int:
    if commands is COMMANDS and argv and argv[0] in LAB_COMMANDS:
        print(f"{prog} {argv[0]}: a lab command; run `python -m sp_lab {argv[0]}` (or `python3 dev.py {argv[0]}`) "
              "from the repository root", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog=prog, description=description)
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (module_name, help_text) in commands.items():
        modules[name] = importlib.import_module(module_name)
        modules[name].add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    return modules[args.command].run(args) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
