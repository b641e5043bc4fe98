"""The conformance matrix report: terminal table, JSON file and junit properties, built from
reports alone (so it is the same with and without xdist).

The runs use a toy implementation and toy topology cases defined in the test's own conftest,
so what each cell must say is known here, independently of the real suites.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

CONFTEST = '''
import pytest
from pytest_weightsync.protocols import Capabilities


class Toy:
    name = "toy"
    capabilities = Capabilities(formats={"compat"})

    def load_weights(self, params, payload, *, format, spec, topology, rank):
        pass


class ToyCase:
    """Looks like suites/matrix.Case to the report: spec, receiver and an id."""

    def __init__(self, id):
        self.id, self.spec, self.receiver = id, None, None


@pytest.fixture
def weightsync_implementations():
    return [Toy]


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        metafunc.parametrize("case", [ToyCase("topoA"), ToyCase("topoB")], ids=["topoA", "topoB"])
'''

TESTS = '''
import pytest


@pytest.mark.weightsync_property("bit_exact")
@pytest.mark.parametrize("payload_format", ["compat", "packed"])
def test_bit_exact(weightsync_loader, case, payload_format):
    if payload_format not in weightsync_loader.capabilities.formats:
        pytest.skip(f"{weightsync_loader.name} does not claim {payload_format}")
    if weightsync_loader.name == "toy" and case.id == "topoB":
        raise AssertionError("gate/up halves swapped\\nfirst at layer=0 expert=1 projection=gate")


@pytest.mark.weightsync_property("in_place")
def test_in_place(weightsync_loader, case):
    pass


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


@pytest.fixture
def toy(pytester: pytest.Pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_toy=TESTS)
    pytester.makeini("[pytest]\nmarkers =\n    weightsync_backend(name): backend\n")
    return pytester


def _check_json(data: dict) -> None:
    names = [i["name"] for i in data["implementations"]]
    assert names == ["reference", "toy"]
    assert data["properties"] == ["bit_exact", "in_place"]
    assert data["topologies"] == ["topoA", "topoB"]
    assert data["summary"]["toy"]["bit_exact"] == {"passed": 1, "failed": 1, "skipped": 0}
    assert data["summary"]["toy"]["in_place"] == {"passed": 2, "failed": 0, "skipped": 0}
    assert data["summary"]["reference"]["bit_exact"] == {"passed": 2, "failed": 0, "skipped": 0}
    cell = next(c for c in data["cells"]
                if (c["implementation"], c["property"], c["topology"]) == ("toy", "bit_exact", "topoB"))
    assert cell["outcome"] == "failed"
    assert cell["tests"] == {"failed": 1, "skipped": 1}
    assert "gate/up halves swapped" in cell["failures"][0]["message"]
    assert "layer=0 expert=1 projection=gate" in cell["failures"][0]["message"]
    assert cell["failures"][0]["format"] == "compat"
    assert cell["skip_reasons"] == ["toy does not claim packed"]
    assert data["backends"] == {"sglang": {"passed": 1, "failed": 0, "skipped": 1}}
    verdicts = {i["name"]: i["verdict"] for i in data["implementations"]}
    assert verdicts == {"reference": "passed", "toy": "failed"}
    assert not any(t["nodeid"].endswith("test_untagged") for t in data["tests"])


def test_matrix_json_and_junit_from_one_run(toy: pytest.Pytester):
    result = toy.runpytest("--weightsync-report", "out/report.json", "--junitxml", "junit.xml")
    result.assert_outcomes(passed=11, failed=1, skipped=3)
    result.stdout.re_match_lines([
        r".*weightsync conformance matrix.*",
        r"implementation\s+bit_exact\s+in_place\s+verdict",
        r"reference\s+2/0/0\s+2/0/0\s+PASS",
        r"toy\s+1/1/0\s+2/0/0\s+FAIL",
        r"\s+toy / bit_exact / topoB: AssertionError: gate/up halves swapped",
    ], consecutive=False)
    result.stdout.fnmatch_lines(["*reference suites*receiver_layout 1/0/1*"])
    _check_json(json.loads((toy.path / "out" / "report.json").read_text()))

    cases = ET.parse(toy.path / "junit.xml").getroot().iter("testcase")
    props = {c.get("name"): {p.get("name"): p.get("value") for p in c.iter("property")}
             for c in cases}
    assert props["test_bit_exact[toy-topoB-compat]"] == {
        "weightsync_implementation": "toy", "weightsync_property": "bit_exact",
        "weightsync_topology": "topoB", "weightsync_format": "compat"}
    assert props["test_backend_two"]["weightsync_backend"] == "sglang"


def test_matrix_is_the_same_under_xdist(toy: pytest.Pytester):
    pytest.importorskip("xdist")
    result = toy.runpytest_subprocess("-n", "2", "--weightsync-report", "report.json")
    result.assert_outcomes(passed=11, failed=1, skipped=3)
    result.stdout.re_match_lines([r"toy\s+1/1/0\s+2/0/0\s+FAIL"], consecutive=False)
    _check_json(json.loads((toy.path / "report.json").read_text()))


def test_no_matrix_but_an_empty_report_without_tagged_tests(pytester: pytest.Pytester):
    pytester.makepyfile("def test_plain():\n    pass\n")
    result = pytester.runpytest("--weightsync-report", "out/r.json")
    result.assert_outcomes(passed=1)
    assert "conformance matrix" not in result.stdout.str()
    data = json.loads((pytester.path / "out" / "r.json").read_text())
    assert data["tests"] == [] and data["cells"] == [] and data["implementations"] == []
