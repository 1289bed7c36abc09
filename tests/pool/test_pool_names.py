"""Another local user cannot interfere with a pool through its names: shared-memory names carry a random part per
segment (not predictable from pid + pool token + counter), the workers' argv (world-readable in /proc) holds no
token, segment or store name, and a pre-created segment under a name the pool might use does not make calls fail."""
from __future__ import annotations

import os
import re
from multiprocessing.shared_memory import SharedMemory

import psutil
import pytest

from sp_runtime.pool.segments import SHM_DIR, Segment
from family_support import at_worlds
from pool_kit import assert_matches, call_toy, reference, toy_checkpoint, toy_inputs

LINUX_SHM = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm to list segments")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    return toy_checkpoint(tmp_path_factory.mktemp("toy"))


pytest_plugins = ["family_pools"]  # the shared plain pools (degree 2 here)


@at_worlds(2)
def test_segment_names_have_a_random_part_per_segment(plain_pool):
    token = plain_pool._token
    first, second = Segment.create(token, "i7", 64), Segment.create(token, "i7", 64)
    try:
        prefix = f"usp_{os.getpid()}_{token}_i7"
        for segment in (first, second):
            assert segment.name.startswith(prefix) and segment.name != prefix
            assert re.fullmatch(r"[0-9a-f]{16,}", segment.name[len(prefix):].lstrip("_")), segment.name
        assert first.name != second.name  # same part, same pool: still two unguessable names
    finally:
        first.release()
        second.release()


@at_worlds(2)
def test_worker_argv_holds_no_token_and_no_spec(plain_pool):
    secrets_ = [plain_pool._token, plain_pool._control.name, plain_pool.log_dir]
    for pid in plain_pool.worker_pids:
        argv = " ".join(psutil.Process(pid).cmdline())
        assert "sp_runtime.pool.worker" in argv
        assert not any(secret in argv for secret in secrets_), argv
        assert "{" not in argv  # no JSON spec at all


@at_worlds(2)
@LINUX_SHM
def test_pre_created_names_do_not_make_calls_fail(plain_pool, checkpoint):
    """The attacker knows everything argv ever showed (old code: the token) and squats every name the counters
    would give next; the calls that need new input and output segments still work."""
    token = plain_pool._token
    squatted = []
    try:
        for part in [f"{kind}{n}" for kind in "iop" for n in range(12)]:
            try:
                squatted.append(SharedMemory(name=f"usp_{os.getpid()}_{token}_{part}", create=True, size=64))
            except FileExistsError:
                pass
        model = plain_pool.load_model(checkpoint)
        for size in [(10, 14), (20, 28), (40, 56)]:  # each larger input grows the arenas: new segments
            inputs = toy_inputs(seed=1, size=size)
            out = model(inputs["x"], inputs["timestep"], context=inputs["context"], y=inputs["y"])
            assert_matches(out, reference(checkpoint)(**inputs))
    finally:
        for shm in squatted:
            shm.close()
            shm.unlink()
