"""`python3 dev.py mutate [ids...]`: plant each bug of tests/mutations.py in a scratch copy of the repository, run
the tests that must catch it, and report killed / survived (docs/DEVELOPMENT.md). Not a test module."""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from mutations import MUTATIONS  # noqa: E402

TIMEOUT_S = 300  # per mutation: its targeted tests only


def stale(mutation: dict, root: str = ROOT) -> str:
    """Why the entry no longer applies ("" when its original text occurs exactly once in its file)."""
    path = os.path.join(root, mutation["file"])
    if not os.path.isfile(path):
        return f"{mutation['file']} does not exist"
    count = open(path, encoding="utf-8").read().count(mutation["original"])
    return "" if count == 1 else f"its original text occurs {count} times in {mutation['file']}, not once"


def scratch_copy() -> str:
    """The working tree's files (tracked and untracked, not ignored: uncommitted changes included) in a temp dir."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    target = tempfile.mkdtemp(prefix="usp_mutate_")
    for name in filter(None, listed):
        source = os.path.join(ROOT, name)
        if os.path.isfile(source):
            os.makedirs(os.path.dirname(os.path.join(target, name)), exist_ok=True)
            shutil.copy2(source, os.path.join(target, name))
    return target


def run_one(mutation: dict, scratch: str, python: str, planted: bool = True) -> tuple[str, float, str]:
    """(outcome, seconds, output tail): killed (its tests fail), survived (they pass), timeout, or error."""
    path = os.path.join(scratch, mutation["file"])
    original = open(path, encoding="utf-8").read()
    if planted:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(original.replace(mutation["original"], mutation["replacement"], 1))
    env = dict(os.environ, PYTHONPATH=scratch, PYTHONDONTWRITEBYTECODE="1")  # never a stale cached module
    started = time.monotonic()
    try:
        done = subprocess.run([python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *mutation["tests"]],
                              cwd=scratch, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        outcome = {0: "survived", 1: "killed"}.get(done.returncode, f"error (pytest exit {done.returncode})")
        tail = (done.stdout + done.stderr)[-1500:]
    except subprocess.TimeoutExpired:
        outcome, tail = "timeout", ""
    finally:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(original)
    return outcome, time.monotonic() - started, tail


def main(argv: list[str], python: str = sys.executable) -> int:
    parser = argparse.ArgumentParser(prog="dev.py mutate", description=__doc__)
    parser.add_argument("ids", nargs="*", help="mutation ids (default: all)")
    parser.add_argument("--baseline", action="store_true",
                        help="run each entry's tests unmutated instead (they must all pass)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--show", action="store_true", help="print the end of every run's pytest output")
    args = parser.parse_args(argv)
    known = {mutation["id"]: mutation for mutation in MUTATIONS}
    unknown = [name for name in args.ids if name not in known]
    if unknown:
        print(f"unknown mutation ids {unknown}; known: {sorted(known)}")
        return 2
    chosen = [known[name] for name in args.ids] if args.ids else MUTATIONS
    if args.list:
        for mutation in chosen:
            print(f"{mutation['id']:<28} {mutation['file']}: {mutation['bug']}")
        return 0
    started, scratch, failures = time.monotonic(), scratch_copy(), 0
    try:
        for mutation in chosen:
            reason = stale(mutation, scratch)
            if reason:
                outcome, seconds, tail = f"stale ({reason})", 0.0, ""
            else:
                outcome, seconds, tail = run_one(mutation, scratch, python, planted=not args.baseline)
            if args.baseline and outcome in ("survived", "killed"):
                outcome = {"survived": "passed", "killed": "failed"}[outcome]
            good = outcome == ("passed" if args.baseline else "killed")
            failures += not good
            print(f"{mutation['id']:<28} {outcome:<10} {seconds:6.1f} s", flush=True)
            if (args.show or not good) and tail:
                print("    " + tail.strip().replace("\n", "\n    "))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    wanted = "passed unmutated" if args.baseline else "killed"
    print(f"{len(chosen) - failures} of {len(chosen)} {wanted}, {failures} not; "
          f"{time.monotonic() - started:.0f} s in all")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
