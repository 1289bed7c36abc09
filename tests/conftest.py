"""Shared pytest setup: the repository root on sys.path so `sp_runtime` imports in tests and spawned workers; tests/
and its folders on sys.path so the support modules here (family_pools, family_support, comfy_support, ...) and the
case builders one test file takes from another (`from test_z_image import make_cases`) import by their plain names,
whichever file pytest runs first (tests/README.md says which folder holds what)."""
import os
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
FOLDERS = sorted(entry.path for entry in os.scandir(TESTS) if entry.is_dir() and not entry.name.startswith(("_", ".")))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
sys.path.extend(path for path in (TESTS, *FOLDERS) if path not in sys.path)

# the tests write and load the lab's toy / synthetic checkpoints (registered here and refused in any other process)
import sp_lab.families  # noqa: E402,F401  (registers them, ULYSSES_SP_INTERNAL_FAMILIES=1)
