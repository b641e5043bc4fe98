"""The toy conformance suite the report's tests run in an inner pytest session: a ``toy``
loader beside the reference on two stand-in topologies (``CONFTEST``), tests of three
properties and two backend checks (``TESTS``), written as the loader module of a package named
like the shipped one - shared by the report, run-end and waiver tests so each cell's expected
word is known in one place.
"""

from __future__ import annotations

import pytest
from toy_sources import LOADER_BASE, TOY_CASES

__all__ = ["CONFTEST", "TESTS", "conformance_package", "stand_ins", "toy"]

CONFTEST = LOADER_BASE + '''

class Toy(_Loader):
    name = "toy"

''' + TOY_CASES

TESTS = '''
import pytest


class NotClaimed(pytest.skip.Exception):
    kind = "unclaimed"  # what the suites' harness raises for a case outside the claims


@pytest.mark.weightsync_property("bit_exact")
@pytest.mark.parametrize("payload_format", ["compat", "packed"])
def test_bit_exact(weightsync_loader, case, payload_format):
    if payload_format not in weightsync_loader.capabilities.formats:
        raise NotClaimed(f"{weightsync_loader.name} does not claim {payload_format}")
    if weightsync_loader.name == "toy" and case.id == "topoB":
        raise AssertionError("gate/up halves swapped\\nfirst at layer=0 expert=1 projection=gate")


@pytest.mark.weightsync_property("in_place")
def test_in_place(weightsync_loader, case):
    pass


@pytest.mark.weightsync_property("hardening")
def test_hardening(weightsync_loader, case, weightsync_record_property):
    strict = weightsync_loader.name == "reference"
    weightsync_record_property("weightsync_bad_kind", "wrong_dtype")
    weightsync_record_property("weightsync_finding", "refused (ValueError)" if strict else
                               "accepted, wrong values written")
    weightsync_record_property("weightsync_finding_detail", "dtype float32" if strict else "")


@pytest.mark.weightsync_backend("sglang")
@pytest.mark.weightsync_property("receiver_layout")
def test_backend_one():
    pass


@pytest.mark.weightsync_backend("sglang")
@pytest.mark.weightsync_property("receiver_layout")
def test_backend_two():
    pytest.skip("sglang missing")


def test_untagged():
    pass
'''


def stand_ins() -> int:
    """Tests the shipped modules other than the toy's add to a run (one stand-in each)."""
    from pytest_weightsync.vocabulary import CONFORMANCE_MODULES

    return len(CONFORMANCE_MODULES) - 1


def conformance_package(pytester: pytest.Pytester, tests: str) -> None:
    """The toy tests as the loader module of a package named like the shipped one; the other
    shipped modules a verdict needs (vocabulary.CONFORMANCE_MODULES) are collected, empty of
    implementation tests."""
    from pytest_weightsync.vocabulary import CONFORMANCE_MODULES

    pytester.mkpydir("conformance")
    for module in CONFORMANCE_MODULES:
        text = tests if module == "test_loader" else f"def {module}_stand_in():\n    pass\n"
        (pytester.path / "conformance" / f"{module}.py").write_text(text)


@pytest.fixture
def toy(pytester: pytest.Pytester):
    pytester.makeconftest(CONFTEST)
    conformance_package(pytester, TESTS)
    pytester.makeini("[pytest]\nmarkers =\n    weightsync_backend(name): backend\n")
    return pytester
