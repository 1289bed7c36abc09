"""Ring attention and the Ulysses x Ring hybrid on gloo equal single-process SDPA, for awkward shapes and text; the
sequence group's all-gather (attention.gather_rows) returns rows in sequence-rank order."""
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from sp_runtime.attention.lse import LseMerger, attention_with_lse, key_padding_bias, math_attention_with_lse
from sp_runtime.local_ranks import run_distributed

HEAD_DIM = 16
# (ulysses_degree, ring_degree): pure ring at 2, 3, 4 ranks, the hybrid, and Ulysses alone through the dispatch
LAYOUTS = [(1, 2), (2, 1), (2, 2), (1, 3), (1, 4)]


def _cases(world_size):
    """Every (length, text, dtype) with heads and batch alternating (each pair of values appears): 18 cases, not
    the 72 of the whole product, which the pairs already cover."""
    short = world_size - 1  # fewer tokens than ranks: some ranks hold none
    for index, (seq_len, (text_len, masked), dtype) in enumerate(itertools.product(
            (63, 189, short), ((0, False), (7, False), (7, True)), (torch.float32, torch.bfloat16))):
        yield seq_len, (3, 6)[index // 2 % 2], text_len, masked, (1, 2)[(index + index // 2) % 2], dtype


def _inputs(seq_len, heads, text_len, masked, batch, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, seq_len, heads, HEAD_DIM, generator=gen).to(dtype) for _ in range(3))
    text = mask = None
    if text_len:
        text = tuple(torch.randn(batch, text_len, heads, HEAD_DIM, generator=gen).to(dtype) for _ in range(3))
    if masked:
        mask = torch.ones(batch, text_len, dtype=torch.bool)
        mask[0, text_len - 3:] = False  # padded text keys in the first prompt only
        mask[-1, 0] = False
    return q, k, v, text, mask


def _reference(q, k, v, text, mask, text_first):
    """Independent reference: the joint sequence in the given order through plain SDPA."""
    text_len = 0 if text is None else text[0].shape[1]
    if text is not None:
        q, k, v = (torch.cat([t, x] if text_first else [x, t], dim=1) for t, x in zip(text, (q, k, v)))
    attn_mask = None
    if mask is not None:
        image = torch.ones(mask.shape[0], q.shape[1] - text_len, dtype=torch.bool)
        attn_mask = torch.cat([mask, image] if text_first else [image, mask], dim=1)[:, None, None, :]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=attn_mask).transpose(1, 2)
    if text is None:
        return out, None
    if text_first:
        return out[:, text_len:], out[:, :text_len]
    return out[:, :-text_len], out[:, -text_len:]


def _counting(module, name, calls):
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        if name == "batch_isend_irecv":
            calls["p2p_ops"] = calls.get("p2p_ops", 0) + len(args[0])
        return original(*args, **kwargs)
    setattr(module, name, counted)


def _run_layout(rank, world_size, ulysses, ring):
    import torch.distributed as dist

    from sp_runtime.attention import SeqShards, gather_rows, sp_attention
    from sp_runtime.config import SPConfig
    from sp_runtime.groups import build_groups

    seq = build_groups(SPConfig(["cpu"] * world_size, ulysses_degree=ulysses, ring_degree=ring)).seq
    calls = {}
    for name in ("batch_isend_irecv", "all_to_all_single"):
        _counting(dist, name, calls)
    results = []
    for index, case in enumerate(_cases(world_size)):
        text_first = index % 3 != 1
        q, k, v, text, mask = _inputs(*case, seed=index)
        # float32 reference from the same (possibly bf16-rounded) inputs: the exact result the output should round to
        text32 = None if text is None else tuple(t.float() for t in text)
        ref_image, ref_text = _reference(q.float(), k.float(), v.float(), text32, mask, text_first)
        shards = SeqShards.balanced(q.shape[1], seq.degree)
        lo, hi = shards.range(seq.rank)
        calls.clear()
        image, text_out = sp_attention(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], seq, shards, text=text,
                                       text_mask=mask, text_first=text_first)
        scale = max(1.0, ref_image.abs().max().item(), 0.0 if text is None else ref_text.abs().max().item())
        err = (image.float() - ref_image[:, lo:hi].float()).abs().max().item() / scale if hi > lo else 0.0
        text_err = 0.0 if text is None else (text_out.float() - ref_text.float()).abs().max().item() / scale
        shapes_ok = image.shape == (q.shape[0], hi - lo, q.shape[2], HEAD_DIM) and image.dtype == q.dtype
        if text is not None:
            shapes_ok = shapes_ok and text_out.shape == text[0].shape and text_out.dtype == q.dtype
        label = (case[:5], str(case[5]), text_first)
        results.append((label, err, text_err, shapes_ok, dict(calls), hi - lo))
    return results, gather_rows(torch.full((2, 3), float(seq.rank)), seq)


@pytest.mark.parametrize("ulysses,ring", LAYOUTS, ids=[f"u{u}r{r}" for u, r in LAYOUTS])
def test_ring_and_hybrid_match_sdpa(ulysses, ring):
    world_size = ulysses * ring
    outcomes = run_distributed(_run_layout, world_size, ulysses, ring, timeout=300)
    in_rank_order = torch.arange(world_size, dtype=torch.float32).repeat_interleave(2)[:, None].expand(-1, 3)
    assert all(torch.equal(gathered, in_rank_order) for _, gathered in outcomes)
    per_rank = [results for results, _ in outcomes]
    for rank, results in enumerate(per_rank):
        for label, err, text_err, shapes_ok, calls, tokens in results:
            bf16 = "bfloat16" in label[1]
            # bf16: each block output is rounded (by the kernel) before the float32 merge and the sum once more:
            # two units of bf16 rounding (2^-7 each) at the output scale
            tolerance = 2 ** -6 if bf16 else 1e-5
            assert shapes_ok, f"rank {rank} case {label}: wrong output shape or dtype"
            assert err <= tolerance, f"rank {rank} case {label}: image max rel err {err}"
            assert text_err <= tolerance, f"rank {rank} case {label}: text max rel err {text_err}"
            # One message pair per ring step (k and v packed), Ulysses' two fused exchanges when U > 1.
            assert calls.get("batch_isend_irecv", 0) == ring - 1, (rank, label, calls)
            assert calls.get("p2p_ops", 0) == 2 * (ring - 1), (rank, label, calls)
            assert calls.get("all_to_all_single", 0) == (2 if ulysses > 1 else 0), (rank, label, calls)
    assert any(tokens == 0 for results in per_rank for *_, tokens in results), \
        "the short case must leave some rank without tokens"


def _masks(total):
    """Sequence masks over `total` tokens: block-causal segments (with invalid keys), a sliding window (function)."""
    from sp_runtime.attention import FunctionMask, Segment, SegmentMask
    cut = [0, 5, total // 3, total // 3 + 4, total]
    segments = [Segment(a, b, causal) for a, b, causal in zip(cut[:-1], cut[1:], (True, False, True, False))]
    valid = torch.ones(2, total, dtype=torch.bool)
    valid[1, 2:4] = False
    return {"segments": SegmentMask(segments, valid),
            "window": FunctionMask(lambda query, key: (query - key).abs() <= 6)}


def _run_masked(rank, world_size, ulysses, ring):
    from sp_runtime.attention import FunctionMask, KeyValues, SeqShards, sp_attention
    from sp_runtime.config import SPConfig
    from sp_runtime.groups import build_groups
    seq = build_groups(SPConfig(["cpu"] * world_size, ulysses_degree=ulysses, ring_degree=ring)).seq
    errors = {}
    for total in (61, 40):
        q, k, v, _, _ = _inputs(total, 3, 0, False, 2, torch.float32, seed=total)
        extra_k, extra_v, _, _, _ = _inputs(13, 3, 0, False, 2, torch.float32, seed=total + 1)
        shards, extra_shards = SeqShards.balanced(total, seq.degree), SeqShards.balanced(13, seq.degree)
        (lo, hi), (extra_lo, extra_hi) = shards.range(seq.rank), extra_shards.range(seq.rank)
        extra = KeyValues(extra_k[:, extra_lo:extra_hi], extra_v[:, extra_lo:extra_hi], extra_shards)
        cases = {**{name: (mask, None) for name, mask in _masks(total).items()},
                 "extra": (None, extra), "window_extra": (FunctionMask(lambda i, j: (i - j).abs() <= 30), extra)}
        for name, (mask, more) in cases.items():
            keys, values = (k, v) if more is None else (torch.cat([k, extra_k], 1), torch.cat([v, extra_v], 1))
            dense = None if mask is None else mask.block((0, total), (0, keys.shape[1]), q.device)
            ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, keys, values)), attn_mask=dense)
            out = sp_attention(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], seq, shards, mask=mask, extra=more)[0]
            errors[(total, name)] = (out - ref.transpose(1, 2)[:, lo:hi]).abs().max().item()
    return errors


def test_sequence_masks_are_exact_under_ulysses_x_ring():
    """sp_attention's extension point: masks (block-causal segments with invalid keys, a mask function) and extra
    keys / values of another branch equal one SDPA under the dense mask, per query block x key block of the ring and
    on the whole sequence inside each Ulysses group (the family tests cover Ulysses alone and pure Ring through
    Qwen-Image 2.1)."""
    for errors in run_distributed(_run_masked, 4, 2, 2, timeout=300):
        assert max(errors.values()) <= 1e-5, errors


def _run_kept_keys(rank, world_size):
    """A branch's own attention keeps its keys / values as Ulysses exchanged them (keep=); the other branch's
    attention takes them as extra keys without exchanging them again: 2 all-to-alls instead of 3, the same
    output."""
    import torch.distributed as dist

    from sp_runtime.attention import KeyValues, SeqShards, sp_attention
    from sp_runtime.config import SPConfig
    from sp_runtime.groups import build_groups
    seq = build_groups(SPConfig(["cpu"] * world_size, ulysses_degree=world_size)).seq
    calls = {}
    _counting(dist, "all_to_all_single", calls)
    q, k, v, _, _ = _inputs(29, 3, 0, False, 2, torch.float32, seed=3)
    pose_q, pose_k, pose_v, _, _ = _inputs(11, 3, 0, False, 2, torch.float32, seed=4)
    shards, pose_shards = SeqShards.balanced(29, world_size), SeqShards.balanced(11, world_size)
    (lo, hi), (pose_lo, pose_hi) = shards.range(rank), pose_shards.range(rank)
    outputs = {}
    for kept in (False, True):
        keys = KeyValues(pose_k[:, pose_lo:pose_hi], pose_v[:, pose_lo:pose_hi], pose_shards)
        sp_attention(pose_q[:, pose_lo:pose_hi], keys.key, keys.value, seq, pose_shards, keep=keys if kept else None)
        calls.clear()
        outputs[kept] = sp_attention(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], seq, shards,
                                     extra=keys.values_times(0.5))[0]
        outputs[kept, "exchanges"] = calls.get("all_to_all_single", 0)
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (
        q, torch.cat([k, pose_k], 1), torch.cat([v, pose_v * 0.5], 1)))).transpose(1, 2)[:, lo:hi]
    return (torch.equal(outputs[True], outputs[False]), (outputs[True] - ref).abs().max().item(),
            outputs[False, "exchanges"], outputs[True, "exchanges"])


def test_kept_keys_skip_the_extra_exchange():
    for same, err, fresh, kept in run_distributed(_run_kept_keys, 2, timeout=120):
        assert same and err <= 1e-5 and (fresh, kept) == (3, 2), (same, err, fresh, kept)


def _guide_reference_bias(total, start, log_w):
    """LTX-2's guide mask written out densely from its definition (independent of GuideMask.block)."""
    bias = torch.zeros(total, total)
    end = start + log_w.numel()
    bias[:start, start:end] = log_w[None, :]
    bias[start:end, :start] = log_w[:, None]
    return bias[None, None]


def _sub_layouts(world_size):
    """name -> this rank's SeqParallel (None: not in it) for Ulysses 1-4, Ring 2 and Ulysses 2 x Ring 2 in one world
    of 4 ranks (every rank makes every group: new_group is collective)."""
    import torch.distributed as dist

    from sp_runtime.config import SPConfig
    from sp_runtime.groups import SeqParallel, build_groups
    rank = dist.get_rank() if world_size > 1 else 0
    layouts = {"u1": SeqParallel.single() if rank == 0 else None}
    if world_size == 1:
        return layouts
    for degree in (2, 3):
        group = dist.new_group(list(range(degree)))
        layouts[f"u{degree}"] = SeqParallel(group, rank, degree) if rank < degree else None
    group = dist.new_group([0, 1])
    layouts["r2"] = SeqParallel(None, 0, 1, group, rank, 2, (0, 1)) if rank < 2 else None
    layouts["u4"] = build_groups(SPConfig(["cpu"] * 4)).seq
    layouts["u2r2"] = build_groups(SPConfig(["cpu"] * 4, ulysses_degree=2, ring_degree=2)).seq
    return layouts


def _run_structured(rank, world_size):
    import sp_runtime.attention.masks as masks
    from sp_runtime.attention import SeqShards, sp_attention
    from sp_runtime.families.ltx2.guides import GuideMask, log_weights
    masks.TILE_ROWS = 7  # tiles that straddle shards, cuts and ring blocks at these tiny sizes
    total, guides = 61, 18
    q, k, v, _, _ = _inputs(total, 3, 0, False, 2, torch.float32, seed=7)
    weights = torch.tensor([0.7] * 9 + [1.0] * 3 + [0.0] + [0.25])  # 14 of 18 guide tokens weighted
    log_w = log_weights(weights, torch.float32)
    segments = _masks(total)["segments"]
    cases = {"guides": (GuideMask(total - guides, log_w), _guide_reference_bias(total, total - guides, log_w)),
             "block_causal": (segments, segments.block((0, total), (0, total), q.device))}
    errors = {}
    for layout, seq in _sub_layouts(world_size).items():
        if seq is None:
            continue
        shards = SeqShards.balanced(total, seq.degree)
        lo, hi = shards.range(seq.rank)
        for name, (mask, dense) in cases.items():
            ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=dense)
            out = sp_attention(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], seq, shards, mask=mask)[0]
            scale = max(1.0, ref.abs().max().item())
            errors[layout, name] = (out - ref.transpose(1, 2)[:, lo:hi]).abs().max().item() / scale
    return errors


def test_structured_masks_are_exact_at_every_layout():
    """Block-structured masks, asked for query tiles only (TILE_ROWS 7 here): LTX-2's guide mask (an additive bias:
    log-weights between denoised and weighted guide tokens, a zero weight, unweighted guide tokens after) and a
    block-causal SegmentMask equal one SDPA under the dense mask, at Ulysses 1-4, Ring 2 and Ulysses 2 x Ring 2, 61
    tokens (uneven shards), 3 heads, batch 2."""
    per_rank = [_run_structured(0, 1)] + run_distributed(_run_structured, 4, timeout=300)
    layouts = {layout for errors in per_rank for layout, _ in errors}
    assert layouts == {"u1", "u2", "u3", "u4", "r2", "u2r2"}, layouts
    worst = max(max(errors.values()) for errors in per_rank)
    assert worst <= 1e-5, per_rank


# ---- the LSE kernels and the merge, in one process -------------------------------------------------------------

def _bhsd(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_attention_with_lse_matches_formula(dtype):
    q, k, v = (_bhsd(2, 3, n, 16, dtype=dtype, seed=seed) for seed, n in ((1, 5), (2, 9), (3, 9)))
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[0, :4] = False
    for bias in (None, key_padding_bias(keep, dtype)):
        out, lse = attention_with_lse(q, k, v, bias, scale=0.3)
        ref_out, ref_lse = math_attention_with_lse(q, k, v, bias, scale=0.3)
        scores = q.float() @ k.float().transpose(-1, -2) * 0.3 + (0 if bias is None else bias.float())
        assert torch.allclose(ref_lse, torch.logsumexp(scores, -1), atol=1e-5)
        assert torch.allclose(lse, ref_lse, atol=1e-4), (lse - ref_lse).abs().max()
        atol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(out.float(), ref_out.float(), atol=atol), (out.float() - ref_out.float()).abs().max()
        assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (2, 3, 5)


def test_lse_merge_of_key_blocks_equals_whole():
    q, k, v = _bhsd(1, 2, 7, 8, seed=4), _bhsd(1, 2, 20, 8, seed=5), _bhsd(1, 2, 20, 8, seed=6)
    k[..., 13:, :] += 4.0  # very different score ranges per block: the merge must rescale
    merger = LseMerger()
    for lo, hi in ((13, 20), (0, 1), (1, 13)):
        merger.add(*attention_with_lse(q, k[:, :, lo:hi], v[:, :, lo:hi]))
    whole = F.scaled_dot_product_attention(q, k, v)
    assert (merger.out - whole).abs().max().item() < 1e-6
    assert torch.allclose(merger.lse, torch.logsumexp(q @ k.transpose(-1, -2) / math.sqrt(8), -1), atol=1e-5)


def test_lse_merge_accumulates_in_float32():
    """bf16 partial outputs (what the kernels return for bf16 inputs) merge in float32: the merge adds no rounding
    of its own, so it equals a float64 merge of the same partials to float32 precision (a bf16 accumulator would
    be off by about 2^-9 of the output scale)."""
    q, k, v = (_bhsd(2, 3, 11, 16, dtype=torch.bfloat16, seed=seed) for seed in (7, 8, 9))
    k = torch.cat([k, k * 3, k - 1], dim=2)  # key blocks of different score ranges
    v = torch.cat([v, -v, 2 * v], dim=2)
    partials = [attention_with_lse(q, k[:, :, lo:hi], v[:, :, lo:hi]) for lo, hi in ((0, 7), (7, 8), (8, 15),
                                                                                       (15, 33))]
    merger = LseMerger()
    for out, lse in partials:
        assert out.dtype == torch.bfloat16
        merger.add(out, lse)
    lse_all = torch.logsumexp(torch.stack([lse.double() for _, lse in partials]), 0)
    exact = sum(out.double() * torch.exp(lse.double() - lse_all).unsqueeze(-1) for out, lse in partials)
    assert merger.out.dtype == torch.float32 and merger.lse.dtype == torch.float32
    assert (merger.out.double() - exact).abs().max().item() < 1e-6 * max(1.0, exact.abs().max().item())
    assert (merger.lse.double() - lse_all).abs().max().item() < 1e-5


def test_empty_inputs_are_refused():
    q = _bhsd(1, 1, 3, 8)
    with pytest.raises(ValueError, match="needs queries and keys"):
        attention_with_lse(q, q[:, :, :0], q[:, :, :0])


def test_cuda_kernel_fallback_and_bias_layout():
    """The CUDA-only code paths that can run here: a kernel that raises is remembered and skipped (the caller then
    uses the float32 formula), and the mask bias is laid out as F.sdpa prepares it for the efficient kernel."""
    from sp_runtime.attention import lse
    q = _bhsd(2, 3, 5, 16, dtype=torch.bfloat16)
    before = len(lse._CUDA_FAILED)
    assert lse._cuda_with_lse(q, q, q, None, 0.25) is None  # CPU tensors: both CUDA kernels raise here
    assert len(lse._CUDA_FAILED) == before + 2
    keep = torch.ones(2, 5, dtype=torch.bool)
    keep[1, 2] = False
    bias = lse._aligned_bias(key_padding_bias(keep, torch.bfloat16), q, q)
    assert bias.shape == (2, 3, 5, 5) and bias.stride(-1) == 1 and bias.stride(0) % 16 == 0
    assert torch.equal(bias[1, 2, 4], torch.tensor([0, 0, float("-inf"), 0, 0], dtype=torch.bfloat16))
