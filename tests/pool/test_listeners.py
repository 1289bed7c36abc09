"""What listens: the probes the doctor and bench spawn (sp_runtime.local_ranks) rendezvous through an owner-only
file, not a TCPStore (which listens on every interface, without authentication), and their gloo links stay on the
loopback interface: every listening socket of a probe rank is on 127.0.0.1 or ::1. (The pool's workers: see
test_pool_reliability.)"""
from __future__ import annotations

import psutil

from sp_runtime.local_ranks import run_distributed

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def _listening(rank: int, world_size: int) -> list:
    """This rank's listening sockets, after the process group is up (and one collective used its links)."""
    import torch
    import torch.distributed as dist
    dist.all_reduce(torch.ones(1))
    return sorted({conn.laddr.ip for conn in psutil.Process().net_connections("inet")
                   if conn.status == psutil.CONN_LISTEN})


def test_probe_ranks_listen_on_loopback_only():
    per_rank = run_distributed(_listening, 2, threads=1, timeout=120)
    assert all(set(addresses) <= LOOPBACK for addresses in per_rank), per_rank
