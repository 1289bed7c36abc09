#!/usr/bin/env python3
"""Developer entry point: `python3 dev.py demo` and `python3 dev.py test` set up .venv as needed, then run;
`python3 dev.py mutate [ids...]` plants the bugs of tests/mutations.py one at a time (docs/DEVELOPMENT.md).

The virtual environment sees system site-packages so an existing torch (for example ComfyUI's) is reused; only
when no torch is importable does it install torch==2.13.0 (never listed in requirements.txt: ComfyUI owns torch).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv

ROOT = os.path.dirname(os.path.abspath(__file__))
VENV = os.path.join(ROOT, ".venv")
PYTHON = os.path.join(VENV, "Scripts" if os.name == "nt" else "bin", "python")
REQUIREMENTS = ["requirements.txt", "requirements-dev.txt"]
STAMP = os.path.join(VENV, ".ulysses_sp_setup")
TORCH_PIN = "torch==2.13.0"


def _requirements_digest() -> str:
    digest = hashlib.sha256(TORCH_PIN.encode())
    for name in REQUIREMENTS:
        with open(os.path.join(ROOT, name), "rb") as handle:
            digest.update(handle.read())
    return digest.hexdigest()


def _pip(*args: str) -> None:
    subprocess.run([PYTHON, "-m", "pip", "install", "--disable-pip-version-check", "-q", *args], check=True)


def setup() -> None:
    """Create .venv and install what is missing; a no-op when nothing changed since the last run."""
    if not os.path.exists(PYTHON):
        print("dev.py: creating .venv", flush=True)
        venv.EnvBuilder(with_pip=True, system_site_packages=True).create(VENV)
    digest = _requirements_digest()
    if os.path.exists(STAMP) and open(STAMP).read() == digest:
        return
    if subprocess.run([PYTHON, "-c", "import torch"], capture_output=True).returncode != 0:
        print(f"dev.py: no torch found, installing {TORCH_PIN} (CPU build where available)", flush=True)
        _pip(TORCH_PIN)
    print("dev.py: installing requirements", flush=True)
    _pip(*[arg for name in REQUIREMENTS for arg in ("-r", os.path.join(ROOT, name))])
    with open(STAMP, "w") as handle:
        handle.write(digest)


def main(argv: list[str]) -> int:
    command, rest = (argv[0], argv[1:]) if argv else ("help", [])
    if command not in ("setup", "test", "demo", "bench", "doctor", "mutate"):
        print(__doc__.strip() + "\n\nusage: python3 dev.py {setup,test,demo,bench,doctor,mutate} [args...]")
        return 0 if command in ("help", "-h", "--help") else 2
    setup()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if command == "setup":
        return 0
    if command == "test":
        return subprocess.run([PYTHON, "-m", "pytest", "tests", *rest], cwd=ROOT, env=env).returncode
    if command == "mutate":
        return subprocess.run([PYTHON, os.path.join(ROOT, "tests", "mutate.py"), *rest], cwd=ROOT).returncode
    package = "sp_runtime" if command == "doctor" else "sp_lab"  # the product's command, or the lab's
    return subprocess.run([PYTHON, "-m", package, command, *rest], cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
