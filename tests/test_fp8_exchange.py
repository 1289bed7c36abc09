"""FP8 all-to-all: per-token, per-head scales bound the error by e4m3's rounding of each row's largest value, the
bytes on the wire are (D + 4) per row instead of 2 D (bf16), and Ulysses with it enabled stays within the FP8 bar of
plain SDPA on gloo ranks, sending those bytes."""
import pytest
import torch

from sp_runtime.attention.fp8_exchange import SCALE_BYTES, dequantize, exchange_bytes, quantize
from sp_runtime.cli.gpu_checks import FP8_TOLERANCE, AttentionCase, attention_parity
from sp_runtime.cli.linkprobe import run_ranks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_roundtrip_error_is_bounded_per_row(dtype):
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(2, 3, 5, 7, 64, generator=generator)
    values[0, 0, 0] *= 1000  # one loud token must not spoil the others' precision
    values[1, 2, 4, 6] = 0  # an all-zero (padding) row stays exactly zero
    values = values.to(dtype)
    packed = quantize(values)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 3, 5, 7, 64 + SCALE_BYTES)
    back = dequantize(packed, dtype)
    assert back.dtype == dtype and torch.equal(back[1, 2, 4, 6], values[1, 2, 4, 6])
    error = (back.float() - values.float()).abs()
    row_amax = values.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    assert float((error / row_amax).max()) <= 2 ** -4 + 2 ** -8  # e4m3: 3 mantissa bits (+ bf16 rounding)
    assert float((error / row_amax).max()) > 0  # it really went through fp8
    assert float(error[0, 0, 1:].max()) < 0.2


def test_bytes_on_the_wire_are_about_halved():
    shape = (2, 3, 1, 12, 2304, 128)
    bf16 = exchange_bytes(shape, torch.bfloat16, fp8=False)
    fp8 = exchange_bytes(shape, torch.bfloat16, fp8=True)
    assert bf16 == 2 * 3 * 12 * 2304 * 128 * 2
    assert fp8 / bf16 == pytest.approx(132 / 256)
    assert quantize(torch.zeros(shape[-2:])).numel() == fp8 // (2 * 3 * 12)


def _counted_parity(rank, devices, layout, cases, variants):
    import torch.distributed as dist
    sent = []
    original = dist.all_to_all_single

    def counting(output, input, *args, **kwargs):
        sent.append((input.dtype, input.numel() * input.element_size()))
        return original(output, input, *args, **kwargs)
    dist.all_to_all_single = counting
    rows = attention_parity(rank, devices, layout, cases, variants)
    return rows, sent


def test_ulysses_with_fp8_exchange_stays_near_sdpa_and_sends_fp8_bytes():
    case = AttentionCase("odd63_h6_text_masked", 63, 6, 32, 7, True, 2, "bfloat16").__dict__
    per_rank = run_ranks(_counted_parity, ["cpu", "cpu"], {"ulysses_degree": 2}, [case],
                         [{"name": "plain"}, {"name": "fp8", "fp8_exchange": True}], timeout=120)
    for rows, sent in per_rank:
        plain, fp8 = rows
        assert plain["max_abs_difference"] <= 2e-2 * plain["output_scale"]
        assert 0 < fp8["max_abs_difference"] <= FP8_TOLERANCE * fp8["output_scale"]
        assert fp8["max_abs_difference"] > plain["max_abs_difference"]  # the FP8 path really ran
        (plain_in, plain_back), (fp8_in, fp8_back) = sent[:2], sent[2:]
        assert plain_in[0] == torch.bfloat16 and fp8_in[0] == torch.uint8
        for bf16, packed in ((plain_in, fp8_in), (plain_back, fp8_back)):
            assert packed[1] / bf16[1] == pytest.approx((32 + SCALE_BYTES) / 64)
