"""The host's output arena: results handed out in place while torch can count who holds them, a private copy where it
cannot (the use count is a private torch function); either way a held result never changes under its holder."""
from __future__ import annotations

import secrets

import pytest
import torch

from sp_runtime.pool import arena
from sp_runtime.pool.ownership import TOKEN_HEX


def _worker_writes(outputs: arena.OutputArena, region: dict, value: float) -> None:
    outputs.segment.view(region["offset"], torch.float32, tuple(region["shape"])).fill_(value)


@pytest.mark.parametrize("use_count", ["counted", "missing"])
def test_a_held_result_never_changes(monkeypatch, use_count):
    if use_count == "missing":
        monkeypatch.setattr(arena, "_USE_COUNT", None)
    outputs = arena.OutputArena(secrets.token_hex(TOKEN_HEX // 2))
    try:
        region = outputs.region(torch.float32, (2, 3))
        _worker_writes(outputs, region, 1.0)
        held = outputs.read(region, torch.float32)
        in_place = held.untyped_storage().data_ptr() == outputs.segment.base.data_ptr()
        assert in_place == (use_count == "counted")
        region = outputs.region(torch.float32, (2, 3))
        _worker_writes(outputs, region, 2.0)
        assert torch.equal(held, torch.ones(2, 3))
        assert torch.equal(outputs.read(region, torch.float32), torch.full((2, 3), 2.0))
        del held
    finally:
        outputs.release()
