"""pytest plugin of the model-family tests: one worker pool per Ulysses degree (1-4), shared by test_qwen_image and
test_flux (both declare `pytest_plugins = ["family_pools"]`). Session scope lets pytest run every degree-1 test of
both modules, then every degree-2 test, ..., so each pool starts once."""
import pytest

from sp_runtime.config import SPConfig
from sp_runtime.pool import WorkerPool

DEGREES = (1, 2, 3, 4)


@pytest.fixture(scope="session", params=DEGREES, ids=lambda degree: f"degree{degree}")
def family_pool(request):
    with WorkerPool(SPConfig(["cpu"] * request.param)) as workers:
        yield workers


def pytest_terminal_summary(terminalreporter):
    """The largest relative parity error per kind of check (measured numbers for reports)."""
    from family_support import PARITY_LOG, TOLERANCE
    if not PARITY_LOG:
        return
    worst: dict[tuple[str, str], tuple[float, int]] = {}
    for what, dtype, error in PARITY_LOG:
        key = (what.split("/", 1)[0], dtype)
        best, count = worst.get(key, (0.0, 0))
        worst[key] = (max(best, error), count + 1)
    terminalreporter.section("model-family parity (max |out - ref| / max(1, max |ref|))")
    for (kind, dtype), (error, count) in sorted(worst.items()):
        terminalreporter.write_line(f"{kind:<22} {dtype:<14} {error:.2e} (tolerance {TOLERANCE[dtype]:.1e}, "
                                    f"{count} outputs)")
