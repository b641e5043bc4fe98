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
pytest.importorskip("torch.utils._python_dispatch")  # what the op counter imports, and
pytest.importorskip("torch._dynamo")  # what entering a dispatch mode imports on first use

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
    # a baseline below the measured value can only pass; far below, because the second run
    # times a sleep again on a machine that may be busy (a ratio can move 3x between runs)
    baseline = write_baseline(pytester, {"fast_path": ratio * 0.01})
    result = pytester.runpytest(f"--weightsync-baseline={baseline}")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*throughput vs baseline*", "fast_path*ok"])


def _regressed(pytester, baseline, lines) -> None:
    """A run against ``baseline`` whose one test passes and whose guard fails it, printing
    ``lines``."""
    result = pytester.runpytest(f"--weightsync-baseline={baseline}")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(lines)


def test_injected_drop_fails_the_run_with_a_table(pytester):
    pytester.makepyfile(MEASURED.format(slow=20))  # ratio far below the stored 50.0
    baseline = write_baseline(pytester, {"fast_path": 50.0})
    _regressed(pytester, baseline,
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


def test_new_entries_are_listed_and_pass(pytester):
    pytester.makepyfile(MEASURED.format(slow=1))
    baseline = write_baseline(pytester, {})
    result = pytester.runpytest(f"--weightsync-baseline={baseline}")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["fast_path*new", "*measured entries absent from the baseline: fast_path*"])


def test_entry_whose_baseline_names_no_test_fails_when_not_measured(pytester):
    pytester.makepyfile(MEASURED.format(slow=1))
    baseline = write_baseline(pytester, {"gone_path": 0.5})
    result = pytester.runpytest(f"--weightsync-baseline={baseline}")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "gone_path*0.500*NOT MEASURED",
            "*baseline entry gone_path was not measured: the baseline names no test that measures it*",
        ]
    )


SKIPPING = MEASURED + """

def test_skipped_path(throughput):
    pytest.skip("no accelerator here")
    throughput.measure("skipped_path", lambda: None, 1 << 20)
"""


def _saved_with_skipped_entry(pytester):
    """A baseline saved from a run where both paths measured, named by their tests."""
    pytester.makepyfile(SKIPPING.format(slow=1).replace('pytest.skip("no accelerator here")', "pass"))
    saved = pytester.path / "saved.json"
    pytester.runpytest(f"--weightsync-save-baseline={saved}").assert_outcomes(passed=2)
    data = json.loads(saved.read_text())
    assert data["sources"]["skipped_path"].endswith(".py::test_skipped_path")
    assert "/" not in data["sources"]["skipped_path"]
    data["ratios"] = {k: v * 0.01 for k, v in data["ratios"].items()}  # ratios cannot regress
    saved.write_text(json.dumps(data))
    pytester.makepyfile(SKIPPING.format(slow=1))
    return saved


def test_entry_whose_test_was_skipped_fails_the_run(pytester):
    saved = _saved_with_skipped_entry(pytester)
    result = pytester.runpytest(f"--weightsync-baseline={saved}")
    result.assert_outcomes(passed=1, skipped=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "skipped_path*NOT MEASURED",
            "*baseline entry skipped_path was not measured:*::test_skipped_path skipped: no accelerator here*",
        ]
    )


def test_entry_whose_test_was_deselected_is_listed_not_failed(pytester):
    saved = _saved_with_skipped_entry(pytester)
    result = pytester.runpytest(f"--weightsync-baseline={saved}", "-k", "fast_path")
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        ["skipped_path*not run (*::test_skipped_path deselected or not collected)",
         "*baseline entries not run (their tests were deselected): skipped_path*"]
    )


COUNTED = """
import torch

def test_counted(throughput):
    src = [torch.arange(8, dtype=torch.int16) for _ in range(4)]
    out = torch.empty(32, dtype=torch.int16)
    def path():
        {body}
    c = throughput.count_ops("ops/path", path)
    assert torch.equal(out, torch.cat(src))
"""
BATCHED = "torch.cat(src, out=out)"
LOOPED = "[out[8 * i:8 * i + 8].copy_(s) for i, s in enumerate(src)]"


def test_counts_are_saved_and_an_increase_fails_the_run_naming_the_field(pytester):
    pytester.makepyfile(COUNTED.format(body=BATCHED))
    saved = pytester.path / "saved.json"
    pytester.runpytest(f"--weightsync-save-baseline={saved}").assert_outcomes(passed=1)
    data = json.loads(saved.read_text())
    assert data["counts"]["ops/path"] == {
        "op:aten.cat.out": 1, "bytes_written": 64, "allocations": 0, "allocated_bytes": 0,
    }
    assert pytester.runpytest(f"--weightsync-baseline={saved}").ret == 0
    pytester.makepyfile(COUNTED.format(body=LOOPED))  # the same bytes, one copy per source
    _regressed(pytester, saved,
        [
            "*weightsync throughput REGRESSION*",
            "ops/path*op:aten.copy_.default*0*4*MORE",
            "*does more per call than the baseline records*",
        ]
    )


def test_fewer_counts_pass_with_a_note(pytester):
    pytester.makepyfile(COUNTED.format(body=BATCHED))
    baseline = pytester.path / "b.json"
    baseline.write_text(json.dumps({"counts": {"ops/path": {
        "op:aten.cat.out": 1, "op:aten.copy_.default": 4, "bytes_written": 128,
        "allocations": 0, "allocated_bytes": 0}}}))
    result = pytester.runpytest(f"--weightsync-baseline={baseline}")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["ops/path*op:aten.copy_.default*4*0*fewer (update the baseline)"])


def _usage_error(pytester, source: str, option: str, message: str, **files: str) -> None:
    """A run of ``source`` with ``option`` (and ``files`` written first) stops as a usage error
    whose message matches ``message``."""
    pytester.makepyfile(source)
    for name, text in files.items():
        (pytester.path / name).write_text(text)
    result = pytester.runpytest(option)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_malformed_counts_are_a_clear_usage_error(pytester):
    _usage_error(pytester, COUNTED.format(body=BATCHED), "--weightsync-baseline=bad.json",
                 "*'counts' must map name -> {field: non-negative int}*",
                 **{"bad.json": '{"counts": {"ops/path": {"bytes_written": -1}}}'})


def test_missing_baseline_file_is_a_clear_usage_error(pytester):
    _usage_error(pytester, MEASURED.format(slow=1), "--weightsync-baseline=nope.json",
                 "*--weightsync-baseline: file 'nope.json' does not exist*"
                 "--weightsync-save-baseline*")


def test_malformed_baseline_is_a_clear_usage_error(pytester):
    _usage_error(pytester, MEASURED.format(slow=1), "--weightsync-baseline=bad.json",
                 "*'bad.json' has no 'ratios' mapping of name -> positive number*",
                 **{"bad.json": '{"ratios": {"x": "fast"}}'})
    _usage_error(pytester, MEASURED.format(slow=1), "--weightsync-baseline=empty.json",
                 "*'empty.json' has neither 'ratios'*nor 'counts'*", **{"empty.json": "{}"})


def test_tolerance_out_of_range_is_rejected(pytester):
    _usage_error(pytester, MEASURED.format(slow=1), "--weightsync-tolerance=1.5",
                 "*--weightsync-tolerance must be a fraction in [[]0, 1), got 1.5*")


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
