"""Waiver files: a known, accepted deviation shows as WAIVED (cell and verdict), never PASS;
the run exits 0 for it; stale waivers are listed; a malformed file is refused before any test
runs. The toy suite of ``test_report`` fails exactly one test (toy, bit_exact, topoB)."""

from __future__ import annotations

import json

import pytest
from test_report import toy  # noqa: F401  (the toy suite, a fixture shared with the report's tests)

from pytest_weightsync import waivers

FAILING = "conformance/test_loader.py::test_bit_exact[toy-topoB-compat]"


def test_patterns_take_brackets_literally_and_match_from_the_suites_directory():
    (exact, wild) = waivers.parse(f"# comment\n\n{FAILING}  # pads differently\n"
                                  "*test_in_place[toy-*]  # not yet\n", "w.txt")
    assert (exact.pattern, exact.reason, exact.line) == (FAILING, "pads differently", 3)
    assert exact.matches(FAILING)
    assert exact.matches("site-packages/pytest_weightsync/suites/" + FAILING)
    assert not exact.matches(FAILING.replace("topoB", "topoA"))
    # "[toy-topoB-compat]" is not a character class
    assert not exact.matches(FAILING.replace("[toy-topoB-compat]", "t"))
    assert wild.matches("conformance/test_loader.py::test_in_place[toy-topoA]")
    assert not wild.matches("conformance/test_loader.py::test_in_place[reference-topoA]")


@pytest.mark.parametrize("line, words", [
    (FAILING, "needs a reason"),
    (FAILING + "  #   ", "needs a reason"),
    ("test_a test_b  # two patterns", "without spaces"),
])
def test_a_waiver_without_a_reason_or_with_two_patterns_is_refused(line, words):
    with pytest.raises(waivers.WaiverFileError, match=words) as caught:
        waivers.parse(line + "\n", "w.txt")
    assert "w.txt:1" in str(caught.value)
    assert isinstance(caught.value, pytest.UsageError)


def test_a_waived_failure_is_waived_never_pass_and_the_run_exits_zero(toy: pytest.Pytester):
    (toy.path / "waivers.txt").write_text(
        f"{FAILING}  # pads the last expert differently (ENG-1)\n"
        "*::test_in_place[toy-topoA]  # passes: this waiver is stale\n"
        "*::test_nothing_like_this  # matches no test\n")
    result = toy.runpytest("--weightsync-waivers", "waivers.txt", "--weightsync-report",
                           "report.json", "-rx")
    assert result.ret == 0
    outcomes = result.parseoutcomes()
    assert outcomes.get("xfailed") == 1 and "failed" not in outcomes
    result.stdout.re_match_lines([
        r"toy\s+1/0/0 1 WAIVED\s+2/0/0\s+refused 0/1\s+WAIVED",
        r"waivers \(.*waivers.txt\): 1 failure\(s\) waived by 1 of 3 waiver\(s\)",
        r"  line 1: 1 waived: pads the last expert differently \(ENG-1\)",
        r"  line 2: unused \(every matched test passed\): \*::test_in_place\[toy-topoA\]",
        r"  line 3: unused \(matched no test that ran\): \*::test_nothing_like_this",
    ], consecutive=False)
    result.stdout.fnmatch_lines(["*XFAIL*test_bit_exact*waived: pads the last expert*"])
    data = json.loads((toy.path / "report.json").read_text())
    toy_entry = next(i for i in data["implementations"] if i["name"] == "toy")
    assert toy_entry["verdict_word"] == "WAIVED"
    assert toy_entry["verdict"] == "WAIVED (1 waived: pads the last expert differently (ENG-1))"
    assert data["summary"]["toy"]["bit_exact"] == {"passed": 1, "failed": 0, "skipped": 0,
                                                  "waived": 1}
    (test,) = [t for t in data["tests"] if t["nodeid"].endswith("test_bit_exact[toy-topoB-compat]")]
    assert test["outcome"] == "waived" and "gate/up halves swapped" in test["message"]
    listed = {w["line"]: w for w in data["waivers"]["waivers"]}
    assert listed[1]["waived"] == [test["nodeid"]] and listed[1]["unused"] is None
    assert listed[2]["unused"] == "every matched test passed"
    assert listed[3]["unused"] == "matched no test that ran"


def test_without_the_waiver_the_same_run_fails(toy: pytest.Pytester):
    (toy.path / "waivers.txt").write_text("*::test_in_place[toy-topoB]  # another test\n")
    result = toy.runpytest("--weightsync-waivers", "waivers.txt")
    assert result.ret == 1
    outcomes = result.parseoutcomes()
    assert outcomes["failed"] == 1 and "xfailed" not in outcomes
    result.stdout.re_match_lines([r"toy\s+1/1/0\s+2/0/0\s+refused 0/1\s+FAIL"],
                                 consecutive=False)


def test_a_malformed_waiver_file_stops_the_run_before_any_test(toy: pytest.Pytester):
    (toy.path / "waivers.txt").write_text(f"{FAILING}\n")
    result = toy.runpytest("--weightsync-waivers", "waivers.txt")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*waivers.txt:1: a waiver needs a reason*"])
    assert "passed" not in result.stdout.str()
    missing = toy.runpytest("--weightsync-waivers", "no-such-file.txt")
    assert missing.ret == pytest.ExitCode.USAGE_ERROR
    missing.stderr.fnmatch_lines(["*cannot read*no-such-file.txt*"])
