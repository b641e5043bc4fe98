"""How a run ends, in the report: ``--collect-only`` lists the tests without a verdict, Ctrl-C
(in a test, twice, under xdist) is INTERRUPTED with pytest's exit status, the selection options
pick tests by property and format, and the first failure shown is a located difference.

The runs use the toy suite of :mod:`report_toy`, so what each cell must say is known here.
"""

from __future__ import annotations

import json

import pytest
from report_toy import CONFTEST, conformance_package, stand_ins, toy  # noqa: F401  (a fixture)



def test_collect_only_lists_the_tests_and_exits_zero_without_a_verdict(toy: pytest.Pytester):
    for flag in ("--co", "--collect-only"):
        result = toy.runpytest(flag, "-q", "--weightsync-report", "report.json")
        assert result.ret == pytest.ExitCode.OK, result.stdout.str()
        out = result.stdout.str()
        result.stdout.fnmatch_lines(
            ["conformance/test_loader.py::test_bit_exact[[]toy-topoB-compat[]]"])
        for word in ("conformance matrix", "INTERRUPTED", "verdict", "exit status"):
            assert word not in out, out
        data = json.loads((toy.path / "report.json").read_text())
        assert data["exitstatus"] == 0 and data["interrupted"] is None
        assert data["selection"]["collect_only"] is True
        assert {i["name"]: i["verdict"] for i in data["implementations"]} == {
            "reference": "NOT RUN (--collect-only: no test ran)",
            "toy": "NOT RUN (--collect-only: no test ran)"}


INTERRUPTING_TESTS = '''
import pytest


@pytest.mark.weightsync_property("bit_exact")
def test_first(weightsync_loader, case):
    pass


@pytest.mark.weightsync_property("in_place")
def test_ctrl_c(weightsync_loader, case):
    raise KeyboardInterrupt
'''


def _interrupted_json(data: dict) -> None:
    assert data["exitstatus"] == pytest.ExitCode.INTERRUPTED == 2, data["exitstatus"]
    assert data["interrupted"] == "interrupted: KeyboardInterrupt"
    assert {i["name"]: i["verdict_word"] for i in data["implementations"]} == {
        "reference": "INTERRUPTED", "toy": "INTERRUPTED"}


def test_ctrl_c_in_a_test_is_interrupted_with_pytest_exit_status(pytester: pytest.Pytester):
    pytester.makeconftest(CONFTEST)
    conformance_package(pytester, INTERRUPTING_TESTS)
    result = pytester.runpytest("--weightsync-report", "report.json", no_reraise_ctrlc=True)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.re_match_lines([r"toy\s+.*INTERRUPTED \(", r"the run was interrupted: .*"],
                                 consecutive=False)
    _interrupted_json(json.loads((pytester.path / "report.json").read_text()))


SECOND_CTRL_C = '''
import pytest


@pytest.hookimpl(tryfirst={tryfirst})
def pytest_keyboard_interrupt(excinfo):
    raise KeyboardInterrupt("pressed again while pytest formatted the first")
'''


@pytest.mark.parametrize("tryfirst", [False, True], ids=["after-the-report", "before-the-report"])
def test_a_second_ctrl_c_while_pytest_reports_the_first_is_still_interrupted(
        pytester: pytest.Pytester, tryfirst: bool):
    """A second Ctrl-C while pytest formats the first one's traceback ends pytest's handling
    before it sets the exit status: the report still says interrupted, with status 2."""
    pytester.makeconftest(CONFTEST + SECOND_CTRL_C.format(tryfirst=tryfirst))
    conformance_package(pytester, INTERRUPTING_TESTS)
    # a subprocess: the second KeyboardInterrupt leaves pytest's main loop
    result = pytester.runpytest_subprocess("-p", "weightsync", "-p", "no:cacheprovider",
                                           "--weightsync-report", "report.json")
    assert "pressed again while pytest formatted the first" in result.stderr.str()
    _interrupted_json(json.loads((pytester.path / "report.json").read_text()))


def test_tests_are_selected_by_property_and_format(toy: pytest.Pytester):
    # the property name is a -k keyword even where the test's name does not carry it
    by_keyword = toy.runpytest("-k", "receiver_layout", "--co", "-q")
    assert by_keyword.ret == 0
    ids = [line for line in by_keyword.stdout.lines if "::" in line]
    assert sorted(i.split("::")[1] for i in ids) == ["test_backend_one", "test_backend_two"]
    exact = toy.runpytest("--weightsync-property", "bit_exact", "--weightsync-format", "compat",
                          "--co", "-q")
    ids = [line for line in exact.stdout.lines if "::" in line]
    assert ids and all("test_bit_exact" in line and "compat" in line for line in ids)
    # a narrowed run is a narrower run: PARTIAL, never PASS
    ran = toy.runpytest("--weightsync-property", "in_place", "--weightsync-only", "reference",
                        "--weightsync-report", "r.json")
    verdicts = {i["name"]: i["verdict_word"]
                for i in json.loads((toy.path / "r.json").read_text())["implementations"]}
    assert verdicts["reference"] == "PARTIAL", ran.stdout.str()[-2000:]


HANGING_TESTS = '''
import os
import time

import pytest


@pytest.mark.weightsync_property("bit_exact")
@pytest.mark.parametrize("n", range(10))
def test_quick(weightsync_loader, case, n):
    pass


@pytest.mark.weightsync_property("in_place")
def test_hangs(weightsync_loader, case):
    with open(os.environ["WEIGHTSYNC_TEST_HANGING"], "a") as f:
        f.write("hanging\\n")
    time.sleep(120)
'''


def test_ctrl_c_under_xdist_counts_the_selection_not_what_reported(pytester: pytest.Pytester,
                                                                    tmp_path):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) while both xdist workers
    hang: the workers never finish their session, so the selection they collected must have
    reached the controller before - the verdict says how many of all the selected tests ran,
    not "k/k ran" of the k that reported."""
    pytest.importorskip("xdist")
    import os
    import signal
    import subprocess
    import sys
    import time

    pytester.makeconftest(CONFTEST)
    conformance_package(pytester, HANGING_TESTS)
    hanging = tmp_path / "hanging"
    env = dict(os.environ, WEIGHTSYNC_TEST_HANGING=str(hanging))
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "weightsync", "-n", "2", "-p", "no:randomly",
         "-p", "no:cacheprovider", "--weightsync-report", "report.json"],
        cwd=pytester.path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while (not hanging.exists() or len(hanging.read_text().split()) < 2) \
                and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert hanging.exists(), "no test hung"
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    data = json.loads((pytester.path / "report.json").read_text())
    assert data["interrupted"], out
    # 2 implementations x 2 topologies x (10 quick + 1 hanging), stand-ins aside
    per_impl = 2 * (10 + 1)
    assert data["selection"]["known"] is True, out
    assert data["selection"]["selected"] == 2 * per_impl + stand_ins(), data["selection"]
    for impl in data["implementations"]:
        assert impl["verdict_word"] == "INTERRUPTED", impl
        assert impl["total"] == per_impl, impl
        assert impl["ran"] < per_impl, impl
        assert impl["verdict"].startswith(f"INTERRUPTED ({impl['ran']}/{per_impl} ran"), impl


LOCATED_TESTS = '''
import pytest


class Located(AssertionError):
    """As the suites' conformance errors: the first differing element's location."""

    location = "layer=0 expert=1 projection=gate row=0 col=0 receiver_rank=1"


@pytest.mark.weightsync_property("bit_exact")
@pytest.mark.parametrize("rank", [4, 1])
def test_bit_exact(weightsync_loader, case, rank):
    if weightsync_loader.name != "toy" or case.id != "topoA":
        return
    if rank == 4:
        raise IndexError("list assignment index out of range")
    raise Located("experts misplaced: receiver rank 1's slot for expert 1 holds expert 2's "
                  "values\\nfirst at layer=0 expert=1")
'''


def test_the_first_failure_shown_is_a_located_difference(pytester: pytest.Pytester):
    """One run, one property: a loader's raw IndexError on one rank first, the located
    difference on another next - the matrix's failure line and the JSON show the located one."""
    pytester.makeconftest(CONFTEST)
    conformance_package(pytester, LOCATED_TESTS)
    result = pytester.runpytest("-p", "no:randomly", "--weightsync-report", "report.json")
    result.assert_outcomes(failed=2, passed=6 + stand_ins())
    out = result.stdout.str()
    assert out.index("test_bit_exact[toy-topoA-4]") < out.index("test_bit_exact[toy-topoA-1]")
    result.stdout.re_match_lines([
        r"failures \(2 tests; first per implementation and property, a located difference "
        r"before a raw exception.*",
        r"  toy / bit_exact / topoA: conformance\.test_loader\.Located: experts misplaced: "
        r"receiver rank 1's slot for expert 1 holds expert 2's values",
        r"    rerun: .*test_bit_exact\[toy-topoA-1\]"], consecutive=True)
    (failure,) = json.loads((pytester.path / "report.json").read_text())["failures"]
    assert failure["nodeid"].endswith("test_bit_exact[toy-topoA-1]") and failure["located"]
