"""World 1 runs no exchange code: a worker on one rank (Flux.1, Qwen-Image, Wan 2.1, HunyuanVideo, loaded from tiny
files as the pool loads them) calls no collective and no distributed attention, and every attention goes straight to
SDPA without a mask when the call masks nothing (an all-true mask would keep SDPA off its fastest kernels)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import sp_runtime.attention as attention
from family_support import single_rank_worker
from sp_lab.conformance import cases
from sp_lab.tiny_models import write_tiny_checkpoint

CALLS = {"flux": lambda: cases.flux_cases()["odd_latent"],
         "qwen_image": lambda: cases.qwen_image_cases()["odd_latent"],
         "wan": lambda: cases.wan_cases()["45_tokens"],
         "hunyuan_video": lambda: cases.hunyuan_video_cases()["105_tokens"]}
COLLECTIVES = ("all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor", "all_reduce", "broadcast",
               "send", "recv", "isend", "irecv", "batch_isend_irecv", "reduce_scatter_tensor")


@pytest.mark.parametrize("family", sorted(CALLS))
def test_world1_forward_runs_no_exchange_and_unmasked_sdpa(family, tmp_path, monkeypatch):
    worker, context = single_rank_worker(write_tiny_checkpoint(family, str(tmp_path / f"{family}.safetensors")))
    x, timestep, inputs = CALLS[family]()
    assert "attention_mask" not in inputs

    def refused(name):
        def call(*args, **kwargs):
            raise AssertionError(f"{name} called at world 1")
        return call
    for name in COLLECTIVES:
        monkeypatch.setattr(dist, name, refused(f"torch.distributed.{name}"))
    monkeypatch.setattr(attention, "_distributed_attention", refused("_distributed_attention"))
    masks = []
    sdpa = F.scaled_dot_product_attention

    def counted(query, key, value, attn_mask=None, **kwargs):
        masks.append(attn_mask)
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)
    monkeypatch.setattr(F, "scaled_dot_product_attention", counted)
    out = torch.full(worker.info.output_shape(tuple(x.shape)), float("nan"))
    with torch.no_grad():
        worker.forward(x, timestep, inputs, out, context)
    assert not out.isnan().any()
    assert masks and all(mask is None for mask in masks), f"{sum(m is not None for m in masks)} masked SDPA calls"


def test_rotary_tables_are_reused_while_the_ids_stay_the_same(tmp_path, monkeypatch):
    """Every step of a generation has the same token positions: their rotary tables are computed on the first call
    only; another latent size computes its own (and the output equals a fresh worker's)."""
    from sp_runtime.sp import executor
    path = write_tiny_checkpoint("flux", str(tmp_path / "flux.safetensors"))
    worker, context = single_rank_worker(path)
    computed = []
    rotary = executor.rotary
    monkeypatch.setattr(executor, "rotary", lambda *args: computed.append(args) or rotary(*args))
    calls = cases.flux_cases()

    def run(model, name):
        x, timestep, inputs = calls[name]
        out = torch.empty(model.info.output_shape(tuple(x.shape)))
        with torch.no_grad():
            model.forward(x, timestep, inputs, out, context)
        return out
    first = run(worker, "odd_latent")
    streams = len(computed)
    assert streams and torch.equal(run(worker, "odd_latent"), first) and len(computed) == streams
    other = run(worker, "35_tokens")
    assert len(computed) > streams and torch.equal(other, run(single_rank_worker(path)[0], "35_tokens"))
