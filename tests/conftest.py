"""Shared pytest setup: the repository root on sys.path so `sp_runtime` imports in tests and spawned workers."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# the tests write and load the lab's toy / synthetic checkpoints (registered here and refused in any other process)
import sp_lab.families  # noqa: E402,F401  (registers them, ULYSSES_SP_INTERNAL_FAMILIES=1)
