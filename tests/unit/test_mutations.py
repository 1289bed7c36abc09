"""The planted bugs of `python3 dev.py mutate` (tests/mutations.py) still apply: each entry's original text occurs
exactly once in its file and the tests it names exist, so a refactoring cannot silently turn an entry into a no-op.
(The mutation run itself is for developers before a release: docs/DEVELOPMENT.md.)"""
import os

import pytest

from mutate import ROOT, stale
from mutations import MUTATIONS


def test_ids_are_unique_and_every_entry_is_complete():
    assert len({mutation["id"] for mutation in MUTATIONS}) == len(MUTATIONS)
    for mutation in MUTATIONS:
        assert set(mutation) == {"id", "bug", "file", "original", "replacement", "tests"}, mutation["id"]
        assert mutation["original"] != mutation["replacement"] and mutation["tests"], mutation["id"]
        assert not mutation["file"].startswith("tests/"), f"{mutation['id']}: plant bugs in the product"


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[mutation["id"] for mutation in MUTATIONS])
def test_the_original_text_occurs_exactly_once(mutation):
    assert stale(mutation) == "", f"{mutation['id']}: {stale(mutation)}; update tests/mutations.py"


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[mutation["id"] for mutation in MUTATIONS])
def test_the_named_test_files_exist(mutation):
    files = {argument.split("::")[0] for argument in mutation["tests"] if argument.startswith("tests/")}
    assert files and all(os.path.isfile(os.path.join(ROOT, name)) for name in files), mutation["id"]
