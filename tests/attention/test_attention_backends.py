"""Attention backends: SDPA by default, flash-attn / SageAttention only when importable and selected (fakes stand in
for them here), SDPA fallback for calls they cannot serve (masks, fp32), the LSE for ring attention from flash-attn,
and clear errors for unknown or missing backends."""
import math
import sys
import types
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from sp_runtime.attention import backends
from sp_runtime.attention.local import local_attention
from sp_runtime.attention.lse import attention_with_lse, math_attention_with_lse
from sp_runtime.attention.options import AttentionOptions, using


def _fake_flash(calls):
    """flash_attn_func in [B, S, H, D], computed here in float32 (an independent formula, not SDPA)."""
    def flash_attn_func(q, k, v, softmax_scale=None, return_attn_probs=False):
        calls.append(tuple(q.shape))
        scale = softmax_scale or 1 / math.sqrt(q.shape[-1])
        scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v.float()).to(q.dtype)
        return (out, lse, None) if return_attn_probs else out
    return types.SimpleNamespace(flash_attn_func=flash_attn_func)


@pytest.fixture
def fake_flash(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash(calls))
    monkeypatch.setitem(backends.KERNELS, "flash2", replace(backends.KERNELS["flash2"], needs_cuda=False))
    backends._importable.cache_clear()
    backends.FALLBACKS.clear()
    yield calls
    backends._importable.cache_clear()


@pytest.fixture
def no_optional_kernels(monkeypatch):
    for kernel in backends.KERNELS.values():
        monkeypatch.setitem(sys.modules, kernel.module, None)  # import raises ImportError
    backends._importable.cache_clear()
    yield
    backends._importable.cache_clear()


def _qkv(dtype, batch=2, tokens=37, heads=3, head_dim=16):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(batch, tokens, heads, head_dim, generator=generator).to(dtype) for _ in range(3)]


def _sdpa(q, k, v, mask=None):
    mask = None if mask is None else mask[:, None, None, :]
    return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), attn_mask=mask).transpose(1, 2)


def test_sdpa_is_the_default_and_flash_is_used_only_when_selected(fake_flash):
    q, k, v = _qkv(torch.bfloat16)
    local_attention(q, k, v)
    assert fake_flash == []
    for name in ("flash", "flash2", "auto"):
        with using(AttentionOptions(backend=name)):
            out = local_attention(q, k, v)
        torch.testing.assert_close(out.float(), _sdpa(q, k, v).float(), atol=2e-2, rtol=0)
    assert fake_flash == [(2, 37, 3, 16)] * 3


def test_calls_flash_cannot_serve_fall_back_to_sdpa_and_are_counted(fake_flash):
    q, k, v = _qkv(torch.bfloat16)
    mask = torch.ones(2, 37, dtype=torch.bool)
    mask[0, 30:] = False
    with using(AttentionOptions(backend="flash")):
        masked = local_attention(q, k, v, mask=mask)
        fp32 = local_attention(*(x.float() for x in (q, k, v)))
    assert fake_flash == []
    torch.testing.assert_close(masked, _sdpa(q, k, v, mask))
    torch.testing.assert_close(fp32, _sdpa(*(x.float() for x in (q, k, v))))
    assert backends.FALLBACKS == {("flash2", "a mask"): 1, ("flash2", "float32 (needs fp16 / bf16)"): 1}


def test_ring_gets_the_lse_from_flash_when_selected(fake_flash):
    q, k, v = (x.transpose(1, 2) for x in _qkv(torch.bfloat16, tokens=20))
    with using(AttentionOptions(backend="flash")):
        out, lse = attention_with_lse(q, k, v)
    expected_out, expected_lse = math_attention_with_lse(q, k, v)
    assert len(fake_flash) == 1
    torch.testing.assert_close(lse, expected_lse, atol=1e-4, rtol=0)
    torch.testing.assert_close(out.float(), expected_out.float(), atol=2e-2, rtol=0)


def test_a_selected_backend_that_is_not_installed_is_a_clear_error(no_optional_kernels):
    assert backends.resolve("auto") is None  # auto quietly means SDPA
    with pytest.raises(ValueError, match=r"needs flash_attn_interface .* or flash_attn \(pip install flash-attn"):
        backends.resolve("flash")
    with pytest.raises(ValueError, match="sageattention .*pip install sageattention.*attention='sdpa'"):
        backends.resolve("sage")
    with pytest.raises(ValueError, match="attention backend 'xformers' is unknown; use one of sdpa, auto"):
        AttentionOptions(backend="xformers")
    with pytest.raises(ValueError, match="fp8_exchange must be true or false, got 'yes'"):
        AttentionOptions.from_load_options({"fp8_exchange": "yes"})


def test_exchanges_leave_compiled_graphs_without_importing_dynamo_at_start():
    """Importing the attention costs no torch._dynamo (~2 s of CPU per rank); a model loaded with compile=True
    swaps in the compiler-disabled distributed path first, so its compiled blocks break their graphs at the
    exchanges."""
    import subprocess
    probe = ("import sys, types, torch, sp_runtime.attention as a, sp_runtime.model_options as o; "
             "print('torch._dynamo' in sys.modules); m = torch.nn.Module(); "
             "m.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2)]); "
             "o.OptionedModel(types.SimpleNamespace(model=m), {'compile': True}); "
             "print(getattr(a._distributed, '_torchdynamo_disable', False))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True"], out
