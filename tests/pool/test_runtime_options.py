"""A model's runtime load options through the pool (u2 on gloo): fp8_exchange stays within the FP8 bar of the plain
model and really changes the exchange, overlap and attention='auto' (SDPA here) equal it to fp32 rounding, compile
equals it (inductor; 1e-5 x scale), and a backend that is not installed or a bad flag fails the load clearly while
the pool stays usable."""
import shutil

import pytest
import torch

from sp_runtime import SPConfig, WorkerPool
from sp_lab.cli.gpu_checks import FP8_TOLERANCE
from sp_lab.cli.sampling import make_workload, model_timestep
from sp_lab.tiny_models import write_tiny_checkpoint


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = write_tiny_checkpoint("qwen_image", str(tmp_path_factory.mktemp("options") / "q.safetensors"), seed=5,
                                 num_layers=1)
    with WorkerPool(SPConfig(["cpu", "cpu"])) as pool:
        plain = pool.load_model(path, "float32")
        workload = make_workload("qwen_image", plain.info.config, plain.info.in_channels, 72, 88, batch=2,
                                 text_tokens=7, seed=1)  # 9 x 11 tokens: uneven over 2 ranks
        mask = torch.ones(2, 7, dtype=torch.long)
        mask[1, 4:] = 0
        inputs = dict(workload.conditioning, attention_mask=mask)
        t = model_timestep("qwen_image", 0.6, 2)

        def call(handle):
            return handle(workload.noise, t, **inputs)
        yield pool, path, call, call(plain).clone()  # kept across later calls of the pool: a private copy


def _relative(a, b):
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


def test_fp8_exchange_is_near_and_really_used(setup):
    pool, path, call, expected = setup
    error = _relative(call(pool.load_model(path, "float32", fp8_exchange=True)), expected)
    assert 0 < error <= FP8_TOLERANCE
    assert error > 1e-4  # well above fp32 rounding: the values went through fp8


@pytest.mark.parametrize("options", [{"overlap": True}, {"attention": "auto"}, {"attention": "sdpa"}])
def test_exact_options_equal_the_plain_model(setup, options):
    pool, path, call, expected = setup
    assert _relative(call(pool.load_model(path, "float32", **options)), expected) <= 1e-5


@pytest.mark.parametrize("options, message", [({"attention": "sage"}, "needs sageattention"),
                                              ({"compile": "yes"}, "compile must be true or false")])
def test_bad_options_fail_the_load_clearly_and_the_pool_stays_usable(setup, options, message):
    pool, path, call, expected = setup
    with pytest.raises(Exception, match=message):
        pool.load_model(path, "float32", **options)
    assert torch.equal(call(pool.load_model(path, "float32")), expected)


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="torch.compile's inductor needs a C compiler (none on PATH)")
def test_compiled_blocks_equal_eager(setup):
    pool, path, call, expected = setup
    compiled = pool.load_model(path, "float32", compile=True)
    first = call(compiled)  # compiles (warm-up)
    assert _relative(first, expected) <= 1e-5
    assert _relative(call(compiled), expected) <= 1e-5
