"""Ulysses attention at world 1-4 on gloo equals single-process SDPA on the full tensors, for awkward shapes."""
import itertools

import pytest
import torch
import torch.nn.functional as F

from sp_runtime.local_ranks import run_distributed

SEQ_LENS = (63, 64, 189)
HEADS = (3, 6, 24)
TEXT_LENS = (0, 7)
HEAD_DIM = 16


def _cases():
    """Every (length, heads, text) with batch and dtype alternating so that every pair of values appears: 27 cases,
    not the 108 of the whole product."""
    texts = [(text_len, masked) for text_len in TEXT_LENS for masked in (False, True) if text_len or not masked]
    for index, (seq_len, heads, (text_len, masked)) in enumerate(itertools.product(SEQ_LENS, HEADS, texts)):
        yield seq_len, heads, text_len, masked, (1, 2)[index % 2], (torch.float32, torch.bfloat16)[index // 2 % 2]


def _inputs(seq_len, heads, text_len, masked, batch, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, seq_len, heads, HEAD_DIM)
    q, k, v = (torch.randn(shape, generator=gen).to(dtype) for _ in range(3))
    text = None
    mask = None
    if text_len:
        text = tuple(torch.randn(batch, text_len, heads, HEAD_DIM, generator=gen).to(dtype) for _ in range(3))
    if masked:
        mask = torch.ones(batch, text_len, dtype=torch.bool)
        mask[0, text_len - 3:] = False  # padded text keys in the first prompt only
    return q, k, v, text, mask


def _reference(q, k, v, text, mask):
    """Independent reference: concatenate [text, image] and run plain SDPA over everything."""
    if text is not None:
        q, k, v = (torch.cat([t, x], dim=1) for t, x in zip(text, (q, k, v)))
    attn_mask = None
    if mask is not None:
        keep = torch.cat([mask, torch.ones(mask.shape[0], q.shape[1] - mask.shape[1], dtype=torch.bool)], dim=1)
        attn_mask = keep[:, None, None, :]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=attn_mask).transpose(1, 2)
    text_len = 0 if text is None else text[0].shape[1]
    return out[:, text_len:], (out[:, :text_len] if text is not None else None)


def _count_all_to_all(monkeypatch_target):
    import torch.distributed as dist
    calls = {"n": 0}
    original = dist.all_to_all_single

    def counting(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)
    monkeypatch_target.all_to_all_single = counting
    return calls


def _run_cases(rank, world_size):
    import torch.distributed as dist

    from sp_runtime.attention import SeqShards, sp_attention
    from sp_runtime.config import SPConfig
    from sp_runtime.groups import build_groups

    seq = build_groups(SPConfig(["cpu"] * world_size)).seq
    calls = _count_all_to_all(dist)
    errors = []
    for index, case in enumerate(_cases()):
        q, k, v, text, mask = _inputs(*case, seed=index)
        ref_image, ref_text = _reference(q, k, v, text, mask)
        shards = SeqShards.balanced(q.shape[1], seq.degree)
        lo, hi = shards.range(seq.rank)
        before = calls["n"]
        image, text_out = sp_attention(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], seq, shards, text=text,
                                       text_mask=mask)
        exchanges = calls["n"] - before
        scale = max(1.0, ref_image.abs().max().item())
        err = (image.float() - ref_image[:, lo:hi].float()).abs().max().item() / scale if hi > lo else 0.0
        text_err = 0.0
        if text is not None:
            text_err = (text_out.float() - ref_text.float()).abs().max().item() / scale
        shapes_ok = image.shape == (q.shape[0], hi - lo, q.shape[2], HEAD_DIM) and image.dtype == q.dtype
        errors.append((case[:4] + (case[4], str(case[5])), err, text_err, exchanges, shapes_ok))
    return errors


def _run_world4(rank, world_size):
    return _run_cases(rank, world_size), _run_single_group(rank, world_size)


@pytest.fixture(scope="module")
def world4():
    """Both checks' results at world 4 from one start of 4 ranks (per rank: (cases, short / fp16))."""
    return run_distributed(_run_world4, 4, timeout=300)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ulysses_matches_sdpa(world_size, request):
    if world_size == 4:
        per_rank = [cases for cases, _ in request.getfixturevalue("world4")]
    else:
        per_rank = run_distributed(_run_cases, world_size, timeout=300)
    for rank, results in enumerate(per_rank):
        for case, err, text_err, exchanges, shapes_ok in results:
            bf16 = "bfloat16" in case[-1]
            tolerance = 2 ** -7 if bf16 else 1e-5  # bf16: within two units of rounding of the output scale
            assert shapes_ok, f"rank {rank} case {case}: wrong output shape or dtype"
            assert err <= tolerance, f"rank {rank} case {case}: image max rel err {err}"
            assert text_err <= tolerance, f"rank {rank} case {case}: text max rel err {text_err}"
            expected = 0 if world_size == 1 else 2
            assert exchanges == expected, f"rank {rank} case {case}: {exchanges} all-to-alls, expected {expected}"


def _run_single_group(rank, world_size):
    """fp16 and a sequence shorter than the degree (some ranks hold no tokens)."""
    from sp_runtime.attention import SeqShards, sp_attention
    from sp_runtime.config import SPConfig
    from sp_runtime.groups import build_groups

    seq = build_groups(SPConfig(["cpu"] * world_size)).seq
    out = []
    for seq_len, dtype in ((3, torch.float32), (37, torch.float16)):
        q, k, v, text, mask = _inputs(seq_len, 5, 4, True, 2, dtype, seed=seq_len)
        ref_image, ref_text = _reference(q.float(), k.float(), v.float(), tuple(t.float() for t in text), mask)
        shards = SeqShards.balanced(seq_len, seq.degree)
        lo, hi = shards.range(seq.rank)
        image, text_out = sp_attention(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], seq, shards, text=text,
                                       text_mask=mask)
        out.append((seq_len, (image.float() - ref_image[:, lo:hi]).abs().max().item() if hi > lo else 0.0,
                    (text_out.float() - ref_text).abs().max().item(), tuple(image.shape)))
    return out


def test_short_sequence_and_fp16(world4):
    for rank, (_, results) in enumerate(world4):
        for seq_len, err, text_err, shape in results:
            assert err <= 2e-3 and text_err <= 2e-3, (rank, seq_len, err, text_err)
        assert results[0][3][1] == (1 if rank < 3 else 0), "3 tokens on 4 ranks: sizes 1, 1, 1, 0"
