"""Shared pytest setup: the repository root on sys.path so `sp_runtime` imports in tests and spawned workers."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# the tests write and load the project's own toy / synthetic checkpoints (refused in any other process)
os.environ["ULYSSES_SP_INTERNAL_FAMILIES"] = "1"
