"""CFG-parallel through run_forward: batch halves on their own groups, odd batches on all ranks, output assembled
in one shared tensor, equal to a single-process run of the same model."""
import pytest
import torch

from sp_runtime.attention import SeqShards, sp_attention
from sp_runtime.cfg_parallel import run_forward
from sp_runtime.config import SPConfig
from sp_runtime.groups import ParallelGroups, SeqParallel
from sp_runtime.local_ranks import run_distributed

CHANNELS, HEADS, HEAD_DIM, TEXT = 8, 3, 4, 5
TOKENS = 23  # not divisible by 2, 3 or 4
BATCHES = (2, 1, 3, 4)


class TinyJointModel:
    """A WorkerModel with one joint text+image attention layer: x [B, C, N] -> out [B, C, N] (this rank's tokens).

    It reads its sequence group from ctx.groups.seq, like the real families, and records what it was given.
    """

    def __init__(self):
        gen = torch.Generator().manual_seed(7)
        inner = HEADS * HEAD_DIM
        self.wq, self.wk, self.wv = (torch.randn(CHANNELS, inner, generator=gen) / 3 for _ in range(3))
        self.wo = torch.randn(inner, CHANNELS, generator=gen) / 3
        self.seen = []

    def forward(self, x, timestep, inputs, out, ctx):
        seq = ctx.groups.seq
        x = ctx.to_device("x", x)
        context = ctx.to_device("context", inputs["context"])
        mask = inputs.get("mask")
        shards = SeqShards.balanced(x.shape[2], seq.degree)
        lo, hi = shards.range(seq.rank)
        tokens = x[:, :, lo:hi].transpose(1, 2) * (1 + timestep[:, None, None])
        q, k, v = ((tokens @ w).unflatten(2, (HEADS, HEAD_DIM)) for w in (self.wq, self.wk, self.wv))
        text = tuple((context @ w).unflatten(2, (HEADS, HEAD_DIM)) for w in (self.wq, self.wk, self.wv))
        image, text_out = sp_attention(q, k, v, seq, shards, text=text, text_mask=mask)
        result = (image.flatten(2) + text_out.flatten(2).mean(1, keepdim=True)) @ self.wo
        out[:, :, lo:hi] = result.transpose(1, 2)
        ctx.check_cancel()
        groups = ctx.groups  # a layout without CFG: the family must not split the batch again
        assert groups.cfg_degree == 1 and groups.cfg_rank == 0 and groups.config.sp_degree == seq.degree
        assert groups.rank == seq.rank and groups.seq_all is seq
        self.seen.append((x.shape[0], seq.degree, seq.ring_degree, seq.rank))


class PlainContext:
    """The CallContext contract without the pool: inputs stay on the CPU, cancel checks are counted."""

    def __init__(self, groups):
        self.device = torch.device("cpu")
        self.groups = groups
        self.moved = []
        self.cancel_checks = 0

    def to_device(self, name, tensor, dtype=None):
        self.moved.append((name, tuple(tensor.shape)))
        return tensor.to(self.device, dtype=dtype or tensor.dtype)

    def check_cancel(self):
        self.cancel_checks += 1


def _call_inputs(batch, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, CHANNELS, TOKENS, generator=gen)
    timestep = torch.rand(batch, generator=gen)
    mask = torch.ones(batch, TEXT, dtype=torch.bool)
    mask[-1, TEXT - 2:] = False
    inputs = {"context": torch.randn(batch, TEXT, CHANNELS, generator=gen), "mask": mask,
              "extras": [torch.zeros(1, 3), {"scalar": 1.5}]}  # shared by the batch: passed through unsliced
    return x, timestep, inputs


def _run_calls(rank, world_size, layout, outs):
    from sp_runtime.groups import build_groups

    groups = build_groups(SPConfig.from_layout(["cpu"] * world_size, layout))
    model = TinyJointModel()
    ctx = PlainContext(groups)
    for index, (batch, out) in enumerate(zip(BATCHES, outs)):
        x, timestep, inputs = _call_inputs(batch, seed=index)
        run_forward(model, x, timestep, inputs, out, ctx)
    seq_all = groups.seq_all
    return model.seen, ctx.moved, ctx.cancel_checks, (seq_all.degree, seq_all.rank, seq_all.ring_global_ranks)


def _single_process(batch, seed):
    config = SPConfig(["cpu"])
    groups = ParallelGroups(config, 0, SeqParallel.single(), None, 0, None)
    x, timestep, inputs = _call_inputs(batch, seed)
    out = torch.full_like(x, float("nan"))
    run_forward(TinyJointModel(), x, timestep, inputs, out, PlainContext(groups))
    return out


@pytest.mark.parametrize("layout,world_size", [("cfg2", 2), ("u2cfg2", 4), ("r2cfg2", 4)])
def test_cfg_parallel_equals_single_process(layout, world_size):
    outs = [torch.full((batch, CHANNELS, TOKENS), float("nan")).share_memory_() for batch in BATCHES]
    per_rank = run_distributed(_run_calls, world_size, layout, outs, timeout=120)
    config = SPConfig.from_layout(["cpu"] * world_size, layout)
    for index, (batch, out) in enumerate(zip(BATCHES, outs)):
        reference = _single_process(batch, seed=index)
        scale = max(1.0, reference.abs().max().item())
        assert not out.isnan().any(), f"batch {batch}: some output was written by no rank"
        err = (out - reference).abs().max().item() / scale
        assert err <= 1e-5, f"{layout} batch {batch}: max rel err {err}"
    for rank, (seen, moved, cancel_checks, seq_all) in enumerate(per_rank):
        cfg_index = config.coords(rank)[0]
        for batch, (got_batch, degree, ring_degree, seq_rank) in zip(BATCHES, seen):
            if batch % 2 == 0:  # split: half the batch on this rank's CFG group (sp_degree ranks)
                assert (got_batch, degree, ring_degree) == (batch // 2, config.sp_degree, config.ring_degree)
                assert seq_rank == rank - cfg_index * config.sp_degree
            else:  # whole batch on every rank: the CFG halves are more ring blocks
                assert (got_batch, degree) == (batch, world_size), (rank, batch, got_batch, degree)
                assert (ring_degree, seq_rank) == (2 * config.ring_degree, rank)
        # to_device got whole inputs (so the pool can keep device copies of unchanged ones), never a half
        assert ("x", (2, CHANNELS, TOKENS)) in moved and ("context", (2, TEXT, CHANNELS)) in moved
        assert cancel_checks == len(BATCHES)
        assert seq_all[0] == world_size and seq_all[1] == rank
        assert seq_all[2] == tuple(r for r in range(world_size) if r % config.ulysses_degree ==
                                   rank % config.ulysses_degree)


def test_without_cfg_the_call_is_unchanged():
    groups = ParallelGroups(SPConfig(["cpu"]), 0, SeqParallel.single(), None, 0, None)
    assert groups.seq_all is groups.seq
    x, timestep, inputs = _call_inputs(2, seed=3)
    out = torch.zeros_like(x)
    model, ctx = TinyJointModel(), PlainContext(groups)
    run_forward(model, x, timestep, inputs, out, ctx)
    assert model.seen == [(2, 1, 1, 0)] and ctx.moved[0] == ("x", (2, CHANNELS, TOKENS))
