"""pytest plugin of the model-family tests: one worker pool per Ulysses degree (1-4) and one per Ring / hybrid /
CFG layout, shared by the family test modules (each declares `pytest_plugins = ["family_pools"]`). Session scope
lets pytest run every degree-1 test of all modules, then every degree-2 test, ..., so each pool starts once (and
only one pool of each fixture is up at a time). `family_subject(name)`: a family's conformance files and reference
outputs (sp_lab.conformance), made once for the conformance suite and the family's own tests."""
import pytest

from family_support import assert_parity
from sp_lab.conformance import conformance
from sp_runtime.config import SPConfig
from sp_runtime.pool import WorkerPool

DEGREES = (1, 2, 3, 4)
LAYOUTS = {"u1r3": (3, dict(ulysses_degree=1, ring_degree=3)),
           "u2r2": (4, dict(ulysses_degree=2, ring_degree=2)),
           "u2cfg2": (4, dict(ulysses_degree=2, cfg_degree=2))}
# tensor-parallel layouts (TP innermost): TP 2 for every family, the others on a cheap subset (world-4 pools are slow
# on 2 cores); test_tensor_parallel.py shares them
TP_LAYOUTS = {"tp2": (2, dict(ulysses_degree=1, tensor_parallel_degree=2)),
              "tp4": (4, dict(ulysses_degree=1, tensor_parallel_degree=4)),
              "u2tp2": (4, dict(ulysses_degree=2, tensor_parallel_degree=2)),
              "r2tp2": (4, dict(ulysses_degree=1, ring_degree=2, tensor_parallel_degree=2)),
              "cfg2tp2": (4, dict(ulysses_degree=1, cfg_degree=2, tensor_parallel_degree=2))}


@pytest.fixture(scope="session", params=DEGREES, ids=lambda degree: f"degree{degree}")
def family_pool(request):
    with WorkerPool(SPConfig(["cpu"] * request.param)) as workers:
        yield workers


@pytest.fixture(scope="session", params=sorted(LAYOUTS))
def layout_pool(request):
    """(layout name, pool) for Ring only, Ulysses x Ring and Ulysses x CFG-parallel."""
    world_size, degrees = LAYOUTS[request.param]
    with WorkerPool(SPConfig(["cpu"] * world_size, **degrees)) as workers:
        yield request.param, workers


@pytest.fixture(scope="session", params=list(TP_LAYOUTS))
def tp_pool(request):
    """(layout name, pool) for TP alone and TP with Ulysses, Ring or CFG."""
    world_size, degrees = TP_LAYOUTS[request.param]
    with WorkerPool(SPConfig(["cpu"] * world_size, **degrees)) as workers:
        yield request.param, workers


@pytest.fixture
def plain_pool(family_pool):
    """family_pool for tests that load their own (toy) models: whatever the test loaded is unloaded after it."""
    yield family_pool
    family_pool.unload_all()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Before pytest orders the tests by their session parameters: a test that picks pools by indirect
    parametrization (`parametrize("family_pool", [2], indirect=True)`) gets the parameter index of that pool in
    DEGREES / LAYOUTS, not its position in its own list. pytest groups tests by index, so without this such a test
    would run among the degree-1 tests and restart the degree-2 pool there (and the degree-1 pool after it)."""
    positions = {"family_pool": {degree: index for index, degree in enumerate(DEGREES)},
                 "layout_pool": {name: index for index, name in enumerate(sorted(LAYOUTS))},
                 "tp_pool": {name: index for index, name in enumerate(TP_LAYOUTS)}}
    for item in items:
        callspec = getattr(item, "callspec", None)
        for name, index_of in positions.items():
            if callspec is not None and name in callspec.params and callspec.params[name] in index_of:
                callspec.indices[name] = index_of[callspec.params[name]]


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


class Subject:
    """One family's files and reference outputs, made on first use and kept for the session."""

    def __init__(self, name: str, folder):
        self.name, self.folder, self.spec = name, folder, conformance(name)
        self.path = self.spec.write(str(folder))
        self.forward = self.spec.reference(self.path)
        self.outputs = {case: self.forward(x, t, **inputs) for case, (x, t, inputs) in self.spec.cases().items()}

    def check(self, pool, path: str, what: str, cases=None, **load) -> None:
        handle = pool.load_model(path, **{**self.spec.load_options, **load})
        family, _, variant = self.name.partition(":")  # "family:variant": a variant checked as a model of its own
        assert handle.info.family == family and (not variant or handle.info.variant == variant), (handle.info, family)
        for case, (x, t, inputs) in self.spec.cases().items():
            if cases is None or case in cases:
                assert_parity(handle(x, t, **inputs), self.outputs[case], "float32", f"{self.name}_{what}/{case}")
        handle.unload()


@pytest.fixture(scope="session")
def family_subject(tmp_path_factory):
    """family_subject(name): the family's conformance Subject (sp_lab.conformance), shared by the conformance suite
    and the family's own test file."""
    made: dict[str, Subject] = {}

    def subject(name: str) -> Subject:
        if name not in made:
            made[name] = Subject(name, tmp_path_factory.mktemp(f"conformance_{name}"))
        return made[name]
    return subject
