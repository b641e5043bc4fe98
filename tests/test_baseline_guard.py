"""The throughput baseline guard: save, compare, fail on a drop with a table, tolerance, errors.

The measured tests here wrap ``time.sleep`` so a path's speed relative to the plain copy can be
set by the test: the guard only ever sees ratios.
"""

from __future__ import annotations

import json

import pytest

pytest_plugins = ["pytester"]

# Imported here, before any in-process run: pytester drops modules first imported inside a run,
# and torch cannot be imported twice in one process.
pytest.importorskip("torch")

MEASURED = """
import time

import pytest

SLOW = {slow!r}

def test_fast_path(throughput):
    nbytes = 1 << 20
    # a path that takes ~SLOW x as long as copying 1 MiB
    m = throughput.measure("fast_path", lambda: time.sleep(0.0004 * SLOW), nbytes, repeats=5, warmup=1, best_of=1)
    assert m.ratio > 0
"""


def write_baseline(pytester, ratios, **extra):
    path = pytester.path / "baseline.json"
    path.write_text(json.dumps({"format": 1, "ratios": ratios, **extra}))
    return path


def test_save_writes_ratios_and_machine_info(pytester):
    pytester.makepyfile(MEASURED.format(slow=1))
    out = pytester.path / "saved.json"
    result = pytester.runpytest(f"--weightsync-save-baseline={out}")
    result.assert_outcomes(passed=1)
    data = json.loads(out.read_text())
    assert set(data["ratios"]) == {"fast_path"}
    assert data["ratios"]["fast_path"] > 0
    assert data["tolerance"] == 0.10
    for key in ("cpu", "gpu", "torch", "python", "world_size"):
        assert key in data["machine"], key
    result.stdout.fnmatch_lines(["*weightsync throughput*", "fast_path*cpu*"])


def test_compare_within_tolerance_passes(pytester):
    pytester.makepyfile(MEASURED.format(slow=1))
    saved = pytester.path / "saved.json"
    pytester.runpytest(f"--weightsync-save-baseline={saved}")
    ratio = json.loads(saved.read_text())["ratios"]["fast_path"]
    # a baseline a little below the measured value can only pass
    baseline = write_baseline(pytester, {"fast_path": ratio * 0.5})
    result = pytester.runpytest(f"--weightsync-baseline={baseline}")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*throughput vs baseline*", "fast_path*ok"])


def test_injected_drop_fails_the_run_with_a_table(pytester):
    pytester.makepyfile(MEASURED.format(slow=20))  # ratio far below the stored 50.0
    baseline = write_baseline(pytester, {"fast_path": 50.0})
    result = pytester.runpytest(f"--weightsync-baseline={baseline}")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "*weightsync throughput REGRESSION*",
            "name*baseline ratio*measured ratio*change*limit*status",
            "fast_path*50.000*45.000*REGRESSED",
            "*dropped by more than the tolerance (10%)*",
        ]
    )


def test_tolerance_option_overrides_default_and_ini(pytester):
    pytester.makepyfile(MEASURED.format(slow=1))
    pytester.makeini("[pytest]\nweightsync_tolerance = 0.05\n")
    # measured ratio is well above 0 and below 1000; with tolerance 0.9999 any ratio >= 0.01% of
    # the baseline passes, with the ini's 5% it fails.
    baseline = write_baseline(pytester, {"fast_path": 100.0})
    failing = pytester.runpytest(f"--weightsync-baseline={baseline}")
    assert failing.ret == pytest.ExitCode.TESTS_FAILED
    failing.stdout.fnmatch_lines(["fast_path*100.000*95.000*REGRESSED"])
    passing = pytester.runpytest(
        f"--weightsync-baseline={baseline}", "--weightsync-tolerance=0.9999"
    )
    assert passing.ret == 0
    passing.stdout.fnmatch_lines(["fast_path*100.000*0.010*ok"])


def test_baseline_file_tolerance_applies_when_none_is_given(pytester):
    pytester.makepyfile(MEASURED.format(slow=1))
    baseline = write_baseline(pytester, {"fast_path": 100.0}, tolerance=0.9999)
    result = pytester.runpytest(f"--weightsync-baseline={baseline}")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["fast_path*100.000*0.010*ok"])


def test_missing_and_new_entries_are_reported(pytester):
    pytester.makepyfile(MEASURED.format(slow=1))
    baseline = write_baseline(pytester, {"gone_path": 0.5})
    result = pytester.runpytest(f"--weightsync-baseline={baseline}")
    result.stdout.fnmatch_lines(
        [
            "fast_path*new",
            "gone_path*0.500*not measured",
            "*baseline entries not measured in this run: gone_path*",
            "*measured entries absent from the baseline: fast_path*",
        ]
    )


def test_missing_baseline_file_is_a_clear_usage_error(pytester):
    pytester.makepyfile(MEASURED.format(slow=1))
    result = pytester.runpytest("--weightsync-baseline=nope.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--weightsync-baseline: file 'nope.json' does not exist*--weightsync-save-baseline*"])


def test_malformed_baseline_is_a_clear_usage_error(pytester):
    pytester.makepyfile(MEASURED.format(slow=1))
    (pytester.path / "bad.json").write_text('{"ratios": {"x": "fast"}}')
    result = pytester.runpytest("--weightsync-baseline=bad.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*'bad.json' has no 'ratios' mapping of name -> positive number*"])


def test_tolerance_out_of_range_is_rejected(pytester):
    pytester.makepyfile(MEASURED.format(slow=1))
    result = pytester.runpytest("--weightsync-tolerance=1.5")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--weightsync-tolerance must be a fraction in [[]0, 1), got 1.5*"])


def test_same_name_from_two_tests_fails_the_run(pytester):
    pytester.makepyfile(
        MEASURED.format(slow=1)
        + """
def test_again(throughput):
    throughput.measure("fast_path", lambda: None, 1 << 20, repeats=5, warmup=1, best_of=1)
"""
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=2)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*recorded by more than one test*fast_path (again in*test_again)*"])
