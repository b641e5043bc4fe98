"""The conformance matrix report: terminal table, JSON file and junit properties, built from
reports alone (so it is the same with and without xdist); claims and verdicts (conformance
against hardening findings, "not run"). How a run ends (``--collect-only``, Ctrl-C) is in
``test_report_run_end.py``.

The runs use a toy implementation and toy topology cases (:mod:`report_toy`, or the test's own
conftest), so what each cell must say is known here, independently of the real suites.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
from report_toy import conformance_package, stand_ins, toy  # noqa: F401  (a fixture)
from toy_sources import LOADER_BASE


def _check_json(data: dict) -> None:
    names = [i["name"] for i in data["implementations"]]
    assert names == ["reference", "toy"]
    assert data["properties"] == ["bit_exact", "in_place", "hardening"]
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
    assert verdicts == {"reference": "PASS", "toy": "FAIL (8/8 ran; 1 failed)"}
    # the failing cell comes with the command that reruns exactly it
    (failure,) = data["failures"]
    assert failure["nodeid"].endswith("test_bit_exact[toy-topoB-compat]")
    assert "--weightsync-only toy" in failure["rerun"] and failure["nodeid"].split("::")[1] in \
        failure["rerun"]
    assert all(c["duration_s"] >= 0 for c in data["cells"])
    assert data["versions"]["pytest"] and "torch" in data["versions"]
    # every topology spelled out, and the grammar of the ids explained once
    assert sorted(data["topology_details"]) == ["topoA", "topoB"]
    assert data["topology_details"]["topoA"] == {"model": {}, "engine": {}}
    assert "T.tp ep etp pp" in data["legend"] and "R.tp ep dp" in data["legend"]
    assert data["started"].endswith("Z") and data["selection"]["deselected"] == 0
    outcomes = {i["name"]: i["outcome"] for i in data["implementations"]}
    assert outcomes == {"reference": "passed", "toy": "failed"}
    assert not any(t["nodeid"].endswith("test_untagged") for t in data["tests"])
    # findings recorded at run time reach the report (under xdist too)
    assert data["hardening"]["toy"] == [{"format": "-", "kind": "wrong_dtype", "findings": [
        {"finding": "accepted, wrong values written", "topologies": ["topoA", "topoB"],
         "detail": ""}]}]
    assert data["hardening"]["reference"][0]["findings"][0]["detail"] == "dtype float32"


def test_matrix_json_and_junit_from_one_run(toy: pytest.Pytester):
    # junit under its default family (xunit2): recording findings must not warn
    result = toy.runpytest("--weightsync-report", "out/report.json", "--junitxml", "junit.xml",
                           "-W", "error::pytest.PytestWarning")
    result.assert_outcomes(passed=15 + stand_ins(), failed=1, skipped=3)
    assert "record_property is incompatible" not in result.stdout.str()
    result.stdout.re_match_lines([
        r".*weightsync conformance matrix.*",
        r"implementation\s+bit_exact\s+in_place\s+hardening\s+verdict",
        r"reference\s+2/0/0\s+2/0/0\s+refused 1/1\s+PASS",
        r"toy\s+1/1/0\s+2/0/0\s+refused 0/1\s+FAIL",
        r"\s+toy / bit_exact / topoB: AssertionError: gate/up halves swapped",
    ], consecutive=False)
    result.stdout.fnmatch_lines([
        "weightsync tests per implementation (passed / failed / skipped): reference 8/0/0, "
        "toy 5/1/2",
        "weightsync tests without an implementation under test (passed / failed / skipped): "
        "receiver_layout 1/0/1"])
    assert "reference suites" not in result.stdout.str()
    _check_json(json.loads((toy.path / "out" / "report.json").read_text()))

    cases = ET.parse(toy.path / "junit.xml").getroot().iter("testcase")
    props = {c.get("name"): {p.get("name"): p.get("value") for p in c.iter("property")}
             for c in cases}
    toy_b = props["test_bit_exact[toy-topoB-compat]"]
    assert toy_b.pop("weightsync_file").endswith("test_loader.py")
    assert toy_b == {
        "weightsync_implementation": "toy", "weightsync_property": "bit_exact",
        "weightsync_topology": "topoB", "weightsync_format": "compat"}
    assert props["test_backend_two"]["weightsync_backend"] == "sglang"
    # properties recorded at run time are there too
    assert props["test_hardening[toy-topoA]"]["weightsync_finding"] == \
        "accepted, wrong values written"


def test_weightsync_list_says_what_would_run_and_runs_nothing(toy: pytest.Pytester):
    result = toy.runpytest("--weightsync-list", "--weightsync-report", "out.json")
    assert result.ret == 0
    out = result.stdout.str()
    assert "conformance matrix" not in out and "PASSED" not in out
    result.stdout.fnmatch_lines([
        "*weightsync: what this run would check*",
        "toy:",
        "  bit_exact: 2 cases over 2 topologies, formats compat",
        "    not selected: 2 outside its claims (2: does not claim the packed format (claims "
        "['compat']))",
        "  in_place: 2 cases over 2 topologies",
        "topologies (selected by some implementation's claims):",
        "  topoA",
    ])


CLAIMS_CONFTEST = '''
import pytest
from pytest_weightsync.protocols import Capabilities
from pytest_weightsync.reference_impl.model.layout import MoESpec, ReceiverTopology


class Case:
    def __init__(self, id, receiver):
        self.id, self.spec, self.receiver = id, MoESpec(1, 4, 8, 4), receiver


CASES = {"dp1": Case("dp1", ReceiverTopology(tp=2, moe_ep=2)),
         "dp2": Case("dp2", ReceiverTopology(tp=4, moe_ep=2, moe_dp=2))}


class Wide:
    name = "wide"
    capabilities = Capabilities(formats={"compat", "packed"})

    def load_weights(self, params, payload, *, format, spec, topology, rank):
        pass


class NoReplicas(Wide):
    """Refuses every engine with MoE-DP replicas (as a vLLM-only loader does)."""

    name = "no-replicas"
    capabilities = Capabilities(formats={"compat", "packed"},
                                topology=lambda spec, receiver: receiver.moe_dp == 1)


@pytest.fixture
def weightsync_implementations():
    return [Wide, NoReplicas]
'''

CLAIMS_TESTS = '''
import pytest

from conftest import CASES


class NotClaimed(pytest.skip.Exception):
    __module__ = "builtins"  # shown as "NotClaimed: reason", as the suites' own

    def __init__(self, reason, kind):
        super().__init__(reason)
        self.kind = kind


def require(impl, case, fmt=None, claim=None):
    """As the suites decide: the property's claim first, then the case."""
    caps = impl.capabilities
    if claim is not None and caps.lifecycle_refusal(claim):
        raise NotClaimed(caps.lifecycle_refusal(claim), "unclaimed")
    why = caps.topology_refusal("loader", case.spec, case.receiver) or (
        caps.format_refusal("loader", fmt, case.receiver) if fmt else None)
    if why:
        raise NotClaimed(why, "outside_topologies")


@pytest.mark.weightsync_property("bit_exact")
@pytest.mark.parametrize("payload_format", ["compat", "packed"])
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_bit_exact(weightsync_loader, case, payload_format):
    require(weightsync_loader, case, payload_format)


@pytest.mark.weightsync_property("coverage_by_rank")
@pytest.mark.parametrize("case", [CASES["dp2"]], ids=["dp2"])
def test_replicas(weightsync_loader, case):
    require(weightsync_loader, case)


@pytest.mark.weightsync_property("version")
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_version(weightsync_loader, case):
    require(weightsync_loader, case, claim="version")
'''


@pytest.fixture
def claims_toy(pytester: pytest.Pytester):
    pytester.makeconftest(CLAIMS_CONFTEST)
    conformance_package(pytester, CLAIMS_TESTS)
    return pytester


def test_weightsync_list_counts_what_the_claims_select(claims_toy: pytest.Pytester):
    """Per implementation: the cases its claims select, the others by reason, a property it
    has that no case fits (NOT RUN, as its verdict will say) and one it does not claim."""
    result = claims_toy.runpytest_subprocess("--weightsync-list")  # the cases import torch
    assert result.ret == 0
    result.stdout.fnmatch_lines([
        "no-replicas:",
        "  bit_exact: 2 cases over 1 topology, formats compat, packed",
        "    not selected: 2 outside its claims (2: its topology predicate refuses this "
        "receiver)",
        "  coverage_by_rank: NOT RUN - no case fits its topologies (1 case outside them: 1: its "
        "topology predicate refuses this receiver)",
        "  version: not claimed (2: does not claim 'version' of the update lifecycle "
        "(Capabilities.lifecycle claims []))",
        "wide:",
        "  bit_exact: 4 cases over 2 topologies, formats compat, packed",
        "  coverage_by_rank: 1 case over 1 topology",
        "  version: not claimed (2: does not claim 'version' *",
        "topologies (selected by some implementation's claims):",
        "  dp1",
        "  dp2",
    ])


def test_a_property_no_case_fits_is_named_in_the_verdict_matrix_and_json(
        claims_toy: pytest.Pytester):
    result = claims_toy.runpytest_subprocess("--weightsync-report", "report.json")
    result.stdout.re_match_lines([
        r"implementation\s+bit_exact\s+coverage_by_rank\s+version\s+verdict",
        r"no-replicas\s+1/0/1\s+NOT RUN\s+not run\s+PARTIAL",  # "not run": not claimed
        r"wide\s+2/0/0\s+1/0/0\s+not run\s+PASS",
        r"  no-replicas: PARTIAL \(7/7 ran; coverage_by_rank: NOT RUN - no case fits this "
        r"implementation's topologies \(1 case\(s\)"], consecutive=False)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    data = json.loads((claims_toy.path / "report.json").read_text())
    rows = {i["name"]: i for i in data["implementations"]}
    assert rows["no-replicas"]["claims_not_run"] == {
        "coverage_by_rank": "NOT RUN - no case fits this implementation's topologies (1 case(s) "
                            "refused: its topology predicate refuses this receiver)"}
    assert rows["wide"]["claims_not_run"] == {}
    cases = rows["no-replicas"]["cases"]
    assert cases["bit_exact"]["selected"] == 2 and cases["bit_exact"]["tests_ran"] == 2
    assert cases["coverage_by_rank"]["selected"] == 0
    assert cases["coverage_by_rank"]["outside"] == {
        "its topology predicate refuses this receiver": 1}
    assert cases["version"]["selected"] == 0 and cases["version"]["outside"] == {}
    assert rows["wide"]["cases"]["coverage_by_rank"] == {
        "selected": 1, "topologies": ["dp2"], "formats": [], "outside": {}, "unclaimed": {},
        "tests_ran": 1}


def test_topologies_are_described_from_the_case_objects():
    from types import SimpleNamespace

    from pytest_weightsync.reference_impl.model.layout import ReceiverTopology, TrainerTopology
    from pytest_weightsync.reference_impl.model.model_spec import qwen3_moe
    from pytest_weightsync.topology import describe, summary

    case = SimpleNamespace(id="x", spec=qwen3_moe(), trainer=TrainerTopology(tp=2, pp=2),
                           receiver=ReceiverTopology(tp=4, order="up_gate"), delivery="colocated")
    described = describe(case)
    assert described["model"]["num_kv_heads"] == qwen3_moe().num_kv_heads
    assert described["trainer"] == {"tp": 2, "ep": 1, "etp": 1, "pp": 2}
    assert described["engine"] == {"tp": 4, "moe_ep": 1, "moe_dp": 1, "order": "up_gate"}
    line = summary(described)
    assert f"{qwen3_moe().num_kv_heads} KV heads" in line and "colocated delivery" in line


def test_matrix_is_the_same_under_xdist(toy: pytest.Pytester):
    pytest.importorskip("xdist")
    result = toy.runpytest_subprocess("-n", "2", "--weightsync-report", "report.json")
    result.assert_outcomes(passed=15 + stand_ins(), failed=1, skipped=3)
    result.stdout.re_match_lines([r"toy\s+1/1/0\s+2/0/0\s+refused 0/1\s+FAIL",
                                  r"    - wrong_dtype\s+accepted, wrong values written"],
                                 consecutive=False)
    _check_json(json.loads((toy.path / "report.json").read_text()))


def test_no_matrix_but_an_empty_report_without_tagged_tests(pytester: pytest.Pytester):
    pytester.makepyfile("def test_plain():\n    pass\n")
    result = pytester.runpytest("--weightsync-report", "out/r.json")
    result.assert_outcomes(passed=1)
    assert "conformance matrix" not in result.stdout.str()
    data = json.loads((pytester.path / "out" / "r.json").read_text())
    assert data["tests"] == [] and data["cells"] == [] and data["implementations"] == []


# --- verdict vs hardening, "not run" ------------------------------------------------------------

VERDICT_CONFTEST = LOADER_BASE + '''

class Lenient(_Loader):
    name = "lenient"


class Narrow(_Loader):
    name = "narrow"


class Halfway(_Loader):
    name = "halfway"


@pytest.fixture
def weightsync_implementations():
    return [Lenient, Narrow, Halfway]


class ToyCase:
    def __init__(self, id):
        self.id, self.spec, self.receiver = id, None, None


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        metafunc.parametrize("case", [ToyCase("topoA"), ToyCase("topoB")], ids=["topoA", "topoB"])
'''

VERDICT_TESTS = '''
import pytest

FINDINGS = {
    "reference": {"wrong_dtype": ("refused (ValueError)", "dtype float32 is not bfloat16"),
                  "unknown_name": ("refused (PayloadError)", "unknown name")},
    "lenient": {"wrong_dtype": ("accepted, result equals the valid entries'", ""),
                "unknown_name": ("crashed after writing (KeyError)", "'x'")},
    "narrow": {"wrong_dtype": ("refused (ValueError)", "dtype"),
               "unknown_name": ("refused (ValueError)", "name")},
    "halfway": {"wrong_dtype": ("refused after writing (ValueError)", "dtype"),
                "unknown_name": ("refused (ValueError)", "name")},
}


@pytest.mark.weightsync_property("bit_exact")
def test_bit_exact(weightsync_loader, case):
    pass


@pytest.mark.weightsync_property("no_stale_values")
def test_no_stale(weightsync_loader, case):
    if weightsync_loader.name == "narrow":
        pytest.skip("narrow claims no topology of this property")


@pytest.mark.weightsync_property("hardening")
@pytest.mark.parametrize("payload_format", ["compat"])
@pytest.mark.parametrize("kind", ["wrong_dtype", "unknown_name"])
def test_hardening(weightsync_loader, case, payload_format, kind, weightsync_record_property):
    finding, detail = FINDINGS[weightsync_loader.name][kind]
    if weightsync_loader.name == "lenient" and case.id == "topoB" and kind == "wrong_dtype":
        finding = "accepted, wrong values written"
    weightsync_record_property("weightsync_bad_kind", kind)
    weightsync_record_property("weightsync_finding", finding)
    weightsync_record_property("weightsync_finding_detail", detail)
    if finding.startswith("refused after writing"):
        raise AssertionError(f"refused a {kind} bucket after writing part of it")
'''


@pytest.fixture
def verdicts(pytester: pytest.Pytester):
    pytester.makeconftest(VERDICT_CONFTEST)
    conformance_package(pytester, VERDICT_TESTS)
    return pytester


def _check_verdict_json(data: dict) -> None:
    impls = {i["name"]: i for i in data["implementations"]}
    assert {n: i["verdict_word"] for n, i in impls.items()} == {
        "halfway": "FAIL", "lenient": "PASS", "narrow": "PARTIAL", "reference": "PASS"}
    # a plain skip of a claimed case is not a pass: the verdict says what did not run
    assert impls["narrow"]["verdict"] == ("PARTIAL (8/8 ran; 2 claimed case(s) skipped: narrow "
                                          "claims no topology of this property)")
    assert impls["narrow"]["not_run"] == ["no_stale_values"]
    assert impls["lenient"]["hardening"] == "refused 0/2"
    assert impls["reference"]["hardening"] == "refused 2/2"
    assert impls["halfway"]["hardening"] == "refused 1/2"
    lenient = {(h["format"], h["kind"]): h["findings"] for h in data["hardening"]["lenient"]}
    assert lenient["compat", "unknown_name"] == [
        {"finding": "crashed after writing (KeyError)", "topologies": ["topoA", "topoB"],
         "detail": "'x'"}]
    assert sorted((f["finding"], f["topologies"]) for f in lenient["compat", "wrong_dtype"]) == [
        ("accepted, result equals the valid entries'", ["topoA"]),
        ("accepted, wrong values written", ["topoB"])]
    assert data["summary"]["narrow"]["no_stale_values"] == {"passed": 0, "failed": 0, "skipped": 2}
    recorded = [t for t in data["tests"] if t.get("finding")]
    assert len(recorded) == 16 and all(t["bad_kind"] in ("wrong_dtype", "unknown_name")
                                       for t in recorded)


VERDICT_LINES = [
    r"implementation\s+bit_exact\s+no_stale_values\s+hardening\s+verdict",
    r"halfway\s+2/0/0\s+2/0/0\s+refused 1/2, 2 failed\s+FAIL$",
    r"lenient\s+2/0/0\s+2/0/0\s+refused 0/2\s+PASS$",
    r"narrow\s+2/0/0\s+not run\s+refused 2/2\s+PARTIAL$",
    r"reference\s+2/0/0\s+2/0/0\s+refused 2/2\s+PASS$",
    r"verdicts:",
    r"  halfway: FAIL \(8/8 ran; 2 failed\)",
    r"  narrow: PARTIAL \(8/8 ran; .*\)",
    r"\s+halfway / hardening / topoA: AssertionError: refused a wrong_dtype bucket after "
    r"writing part of it",
    r"hardening \(bad input; findings, not verdicts.*",
    r"  lenient:",
    r"    compat unknown_name\s+crashed after writing \(KeyError\): 'x'",
    r"    compat wrong_dtype\s+accepted, .* \[1 topology\]; accepted, .* \[1 topology\]",
    r"  reference:",
    r"    compat unknown_name\s+refused \(PayloadError\): unknown name",
]


def test_verdict_counts_conformance_only_and_lists_hardening_findings(verdicts):
    result = verdicts.runpytest("--weightsync-report", "report.json")
    result.assert_outcomes(passed=28 + stand_ins(), failed=2, skipped=2)
    result.stdout.re_match_lines(VERDICT_LINES, consecutive=False)
    _check_verdict_json(json.loads((verdicts.path / "report.json").read_text()))
    out = result.stdout.lines
    start = next(i for i, line in enumerate(out) if "weightsync conformance matrix" in line)
    end = next(i for i, line in enumerate(out) if line.startswith("failures ("))
    assert max(len(line) for line in out[start:end]) <= 120, out[start:end]


def test_a_wide_matrix_is_split_into_tables_of_120_columns():
    from pytest_weightsync.report_collect import ConformanceReport
    from pytest_weightsync.report_matrix import MATRIX_WIDTH
    from pytest_weightsync.verdict import Verdict

    class Wide(ConformanceReport):
        def __init__(self):
            pass

        def verdicts(self):
            return {"impl-a": Verdict("PASS", details=["4 GPU case(s) not run here: " + "x" * 90]),
                    "impl-b": Verdict("FAIL", ran=3, total=3, details=["1 failed"])}

    props = [f"property_{i}" for i in range(12)]
    cells = {(impl, p): f"{i}/0/0" for impl in ("impl-a", "impl-b") for i, p in enumerate(props)}
    lines = Wide()._table_lines(["impl-a", "impl-b"], props, cells)
    assert max(len(line) for line in lines) <= MATRIX_WIDTH
    headers = [line for line in lines if line.startswith("implementation")]
    assert len(headers) >= 2 and headers[-1].endswith("verdict")
    assert all(p in "".join(headers) for p in props)
    assert lines[lines.index("verdicts:") + 1].startswith("  impl-a: PASS (4 GPU case(s)")


def test_shipped_suites_record_properties_without_junit_warnings():
    """pytest's ``record_property`` warns under the default junit family on every test that
    asks for it; the shipped suites record through ``weightsync_record_property``."""
    import ast
    from pathlib import Path

    suites = Path(__file__).resolve().parents[1] / "suites"
    asking = []
    for path in sorted(suites.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    node.name.startswith("test") and \
                    "record_property" in [a.arg for a in node.args.args + node.args.kwonlyargs]:
                asking.append(f"{path.relative_to(suites)}::{node.name}")
    assert not asking, asking
