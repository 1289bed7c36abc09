"""Pools where ComfyUI really runs: names shared with other PID namespaces and the sweep that must spare live pools,
a run folder removed under a live pool, forked children, the rendezvous store, and errors that say what happened."""
from __future__ import annotations

import os
import re
import signal
import stat
import threading
import time
import traceback
from multiprocessing import resource_tracker

import psutil
import pytest
import torch

from sp_runtime.pool import PoolClosedError, PoolForkedError, PoolStartError, RemoteError
from sp_runtime.pool import pool as pool_module
from sp_runtime.pool.ownership import OwnerLock, new_token
from sp_runtime.pool.segments import SHM_DIR, Segment, claim_names, clean_stale_segments
from sp_runtime.pool.spawn import OWNER_FILE, clean_stale_run_dirs
from pool_kit import alive, assert_matches, call_toy, open_pool, reference, toy_checkpoint

LINUX_SHM = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm to list segments")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return toy_checkpoint(tmp_path_factory.mktemp("toy"))


@pytest.fixture(scope="module")
def pool():
    with open_pool(2, error_grace_s=1.0) as pool:
        yield pool


def a_dead_pid() -> int:
    """A PID that runs nothing here: how a pool in another PID namespace looks to this one."""
    process = psutil.Popen(["true"])
    process.wait()
    return process.pid


# ---- item 3: names unique across PID namespaces, a sweep that removes only what is provably dead --------------
@LINUX_SHM
def test_a_live_pool_under_a_pid_that_is_dead_here_keeps_its_segments(pool, monkeypatch):
    dead = a_dead_pid()
    monkeypatch.setattr(os, "getpid", lambda: dead)  # "another namespace": the owner's pid runs nothing here
    token = new_token()
    owner = claim_names(token)
    segment = Segment.create(token, "c", 64)
    try:
        names = (segment.name, os.path.basename(owner.path))
        monkeypatch.undo()
        assert clean_stale_segments() == []  # the owner file is locked: alive, whatever its pid says
        assert all(os.path.exists(os.path.join(SHM_DIR, name)) for name in names)
        assert all(os.path.exists(f"{SHM_DIR}/{name}") for name in pool.segment_names())
        owner.forget()  # the owner dies without cleaning: the kernel drops its lock
        assert sorted(clean_stale_segments()) == sorted(names)
        resource_tracker.unregister(segment.shm._name, "shared_memory")  # the sweep unlinked it
        segment.owner = False
        assert not any(os.path.exists(os.path.join(SHM_DIR, name)) for name in names)
        assert all(os.path.exists(f"{SHM_DIR}/{name}") for name in pool.segment_names())  # never the live pool's
    finally:
        segment.release()
        owner.release()


@LINUX_SHM
def test_two_pools_with_the_same_pid_never_collide(pool, checkpoint):
    with open_pool(1) as other:
        assert os.getpid() == pool._owner_pid == other._owner_pid
        ours, theirs = set(pool.segment_names()), set(other.segment_names())
        assert ours and theirs and not ours & theirs and pool.log_dir != other.log_dir
        prefix = re.compile(rf"^usp_{os.getpid()}_[0-9a-f]{{8}}_")
        assert all(prefix.match(name) for name in ours | theirs)
        out, inputs = call_toy(other.load_model(checkpoint))
        assert_matches(out, reference(checkpoint)(**inputs))


def test_the_run_folder_sweep_spares_live_and_unproven_folders(pool, tmp_path, monkeypatch):
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    live = tmp_path / f"usp_{a_dead_pid()}_{new_token()}_live"
    dead = tmp_path / f"usp_{a_dead_pid()}_{new_token()}_dead"
    unproven = tmp_path / f"usp_{a_dead_pid()}_{new_token()}_nolock"  # no owner file: nothing proves it dead
    for folder in (live, dead, unproven):
        folder.mkdir()
    holder = OwnerLock(str(live / OWNER_FILE))
    OwnerLock(str(dead / OWNER_FILE)).forget()
    try:
        assert clean_stale_run_dirs() == [str(dead)]
        assert live.is_dir() and unproven.is_dir() and not dead.exists()
    finally:
        holder.release()


# ---- item 4: a run folder that disappeared -------------------------------------------------------------------
def test_a_removed_run_folder_is_made_again_on_restart(pool, checkpoint):
    import shutil
    model = pool.load_model(checkpoint)
    shutil.rmtree(pool.log_dir)
    os.kill(pool.worker_pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 5
    while pool.status()["ranks"][0]["alive"] and time.monotonic() < deadline:  # until it can be reaped
        time.sleep(0.05)
    out, inputs = call_toy(model, seed=3)  # restarts in a new folder
    assert_matches(out, reference(checkpoint)(**inputs))
    assert os.path.isfile(os.path.join(pool.log_dir, "worker0.log"))
    assert os.path.isfile(os.path.join(pool.log_dir, OWNER_FILE))


# ---- item 5: fork -------------------------------------------------------------------------------------------
def test_a_forked_child_gets_an_error_and_leaves_the_parents_pool_alone(pool, checkpoint):
    model = pool.load_model(checkpoint)
    busy = threading.Thread(target=call_toy, args=(model,), kwargs={"toy_sleep": 0.5})
    busy.start()  # the pool's lock is held by this thread while the child is forked
    time.sleep(0.3)
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only, never return into pytest
        code = 1
        try:
            torch.set_num_threads(1)  # the parent's CPU thread pool did not survive the fork
            try:
                call_toy(model)
            except PoolForkedError as error:
                assert "forked child" in str(error)
            else:
                raise AssertionError("a forked child used its parent's workers")
            pool.close()  # what the exit hook does: must not touch the parent's workers, segments or folder
            with open_pool(1) as own:  # what the error says to do
                out, inputs = call_toy(own.load_model(checkpoint), seed=8)
                assert_matches(out, reference(checkpoint)(**inputs))
            code = 0
        except BaseException:  # noqa: BLE001 - shown in the test's output, then the exit status fails the test
            traceback.print_exc()
        finally:
            os._exit(code)
    busy.join()
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung on the pool")
    assert os.waitstatus_to_exitcode(done[1]) == 0
    assert pool.state == "idle" and alive(pool.worker_pids) == pool.worker_pids
    assert all(os.path.exists(f"{SHM_DIR}/{name}") for name in pool.segment_names()) or not os.path.isdir(SHM_DIR)
    assert os.path.isdir(pool.log_dir)
    out, inputs = call_toy(model, seed=4)
    assert_matches(out, reference(checkpoint)(**inputs))


# ---- item 10: the rendezvous store --------------------------------------------------------------------------
def test_the_store_is_an_owner_only_file_and_nothing_listens_beyond_loopback(checkpoint):
    me = psutil.Process()
    listening = {conn.laddr for conn in me.net_connections("inet") if conn.status == psutil.CONN_LISTEN}
    with open_pool(2) as pool:
        assert {conn.laddr for conn in me.net_connections("inet")
                if conn.status == psutil.CONN_LISTEN} <= listening  # no port for a stranger to connect to
        for pid in pool.worker_pids:  # gloo's own links: loopback only
            assert all(conn.laddr.ip == "127.0.0.1" for conn in psutil.Process(pid).net_connections("inet")
                       if conn.status == psutil.CONN_LISTEN)
        store = pool._rendezvous.path
        assert os.path.dirname(store) == pool.log_dir
        assert stat.S_IMODE(os.stat(pool.log_dir).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(store).st_mode) & 0o077 == 0
        assert os.stat(store).st_uid == os.getuid()


# ---- item 7: errors that say what happened ------------------------------------------------------------------
def test_close_during_a_call_says_closed_not_oom(checkpoint, monkeypatch):
    monkeypatch.setattr(pool_module, "CLOSE_WAIT_S", 0.5)
    with open_pool(2) as pool:
        model = pool.load_model(checkpoint)
        errors = []

        def run():
            try:
                call_toy(model, toy_sleep=10.0)  # longer than close()'s 5 s grace
            except Exception as error:  # noqa: BLE001 - examined below
                errors.append(error)
        caller = threading.Thread(target=run)
        caller.start()
        time.sleep(0.5)
        pool.close()
        caller.join(timeout=30)
    assert not caller.is_alive() and len(errors) == 1
    assert isinstance(errors[0], PoolClosedError), repr(errors[0])
    assert "closed" in str(errors[0]) and "out-of-memory" not in str(errors[0])


def test_a_short_start_timeout_is_named_exactly_and_names_no_deleted_log():
    with pytest.raises(PoolStartError) as caught:
        with open_pool(2, start_timeout_s=0.5):
            pass
    message = str(caught.value)
    assert "within 0.5 s" in message
    paths = re.findall(r"/\S*usp_\S*", message)
    assert all(os.path.exists(path) for path in paths), paths


def test_cpu_allocation_failure_gets_memory_advice(pool, checkpoint):
    model = pool.load_model(checkpoint)
    with pytest.raises(RemoteError, match=r"out of memory on cpu.*fewer CPU workers") as caught:
        call_toy(model, toy_alloc=2 ** 62)
    assert caught.value.out_of_memory
    assert pool.state == "idle"


@pytest.mark.parametrize("refs, message", [
    ([torch.zeros(2, 3, 4, 4)], r"ref_latents\[0\] has shape \[2, 3, 4, 4\].*\[B, 4, H, W\]"),
    ([torch.zeros(2, 4, 4, 4), torch.zeros(2, 4, 4)], r"ref_latents\[1\] has shape"),
    ([torch.zeros(2, 4, 4, 4, dtype=torch.long)], r"ref_latents\[0\] must be a floating-point"),
    (["latent"], r"ref_latents\[0\] must be a floating-point latent tensor, got str"),
])
def test_bad_reference_latents_fail_on_the_host(pool, checkpoint, refs, message):
    model = pool.load_model(checkpoint)
    calls, events = pool.stats["calls"], []
    pool.add_listener(events.append)
    try:
        with pytest.raises(ValueError, match=message):
            call_toy(model, ref_latents=refs)
    finally:
        pool.remove_listener(events.append)
    assert pool.stats["calls"] == calls and not [e for e in events if e.get("state") == "busy"]
