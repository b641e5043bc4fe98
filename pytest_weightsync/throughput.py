"""The throughput guard: a pytest sub-plugin that fails a run when a ratio drops or a count rises.

Tests measure a path as a ratio to a plain copy of the same bytes in the same run
(:mod:`pytest_weightsync.timing`); the baseline (:mod:`pytest_weightsync.baseline`) stores
ratios only, and this guard compares ratios.

Ratios still move with the machine's load (30-40% on a shared two-core runner); what a path
does per call does not. So tests can also record exact counts (aten operations dispatched,
bytes written, temporaries allocated: :mod:`pytest_weightsync.opcount`), which the guard holds
fixed.

Tests record through the ``throughput`` fixture::

    def test_packed_export_keeps_pace_with_a_plain_copy(throughput):
        m = throughput.measure("packed_tp1", lambda: copy_pairs(pairs), nbytes=payload)
        c = throughput.count_ops("ops/packed", lambda: copy_pairs(pairs))

At the end of the session ``--weightsync-save-baseline FILE`` writes the ratios and counts as
JSON, with the test that measured each entry, and ``--weightsync-baseline FILE`` compares them
with a stored file and fails the run (exit status 1, with a table) when a ratio dropped by
more than the tolerance (``--weightsync-tolerance``, else the ``weightsync_tolerance`` ini
value, else the file's ``tolerance``, else 0.10), when any count rose, or when a stored entry
was not measured although its test was part of the run (skipped, failed, or no longer
recording it); an entry whose test was deselected or not collected is listed as not run.
Measurements travel from xdist workers in ``user_properties``, so the guard works with ``-n``.

Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import pytest

from pytest_weightsync import opcount
from pytest_weightsync.baseline import (
    BASELINE_FORMAT,
    BaselineError,
    Comparison,
    compare,
    comparison_table,
    text_table,
    load_baseline,
    test_key,
)
from pytest_weightsync.timing import Measurement, machine_info, measure

#: Key under which a measurement rides in ``report.user_properties``.
PROPERTY_KEY = "weightsync_throughput"


DEFAULT_TOLERANCE = 0.10


def _ini_is_set(config: pytest.Config, name: str) -> bool:
    """Whether ``name`` was given in an ini file or with ``-o`` (not just its default)."""
    store = getattr(config, "_inicfg", None)  # pytest >= 9 keeps the parsed values here
    if store is None:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            store = getattr(config, "inicfg", None) or {}
    return name in store


def tolerance(config: pytest.Config, baseline: dict[str, Any] | None = None) -> float:
    """The allowed relative drop, from the first of: ``--weightsync-tolerance``, an explicit
    ``weightsync_tolerance`` ini value, the ``tolerance`` stored in the baseline file, 0.10.

    A baseline can carry its own tolerance because the right one depends on the machine
    class it was measured on (a busy two-core CI runner needs more slack than an idle GPU).
    """
    opt = config.getoption("weightsync_tolerance", None)
    if opt is not None:
        value, source = opt, "--weightsync-tolerance"
    elif _ini_is_set(config, "weightsync_tolerance"):
        raw = config.getini("weightsync_tolerance")
        try:
            value = float(raw)
        except ValueError:
            raise pytest.UsageError(f"ini weightsync_tolerance must be a number, got {raw!r}") from None
        source = "ini weightsync_tolerance"
    elif baseline is not None and "tolerance" in baseline:
        value, source = baseline["tolerance"], "the baseline file's 'tolerance'"
    else:
        value, source = DEFAULT_TOLERANCE, "default"
    if not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise pytest.UsageError(f"{source} must be a fraction in [0, 1), got {value!r}")
    return float(value)


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return  # xdist worker: measurements travel to the controller in user_properties
    path = config.getoption("weightsync_baseline", None)
    baseline = None
    if path:
        try:
            baseline = load_baseline(path)
        except BaselineError as exc:
            raise pytest.UsageError(str(exc)) from None
    guard = ThroughputGuard(config, tolerance(config, baseline), baseline)
    config.pluginmanager.register(guard, "weightsync-throughput-guard")


class ThroughputRecorder:
    """What the ``throughput`` fixture returns: measures and records named ratios."""

    def __init__(self, node: pytest.Item):
        self._node = node

    def measure(self, name: str, fn: Callable[[], Any], nbytes: int, **options) -> Measurement:
        """Time ``fn`` and a plain copy of ``nbytes`` interleaved; record ratio under ``name``.

        ``options`` (``device``, ``repeats``, ``warmup``, ``best_of``) are those of
        :func:`pytest_weightsync.timing.measure`: the ratio is the median over ``repeats``
        rounds, each sample the fastest of ``best_of`` calls."""
        m = measure(name, fn, nbytes, **options)
        self.record(m)
        return m

    def record(self, m: Measurement) -> None:
        """Attach ``m`` to the test's report; it counts only if the test passes."""
        self._attach(PROPERTY_KEY, m.name, m.to_json())

    def count_ops(self, name: str, fn: Callable[[], Any]) -> opcount.OpCount:
        """Call ``fn`` once under the op counter and record what it did under ``name``
        (see :mod:`pytest_weightsync.opcount`); returns the counts for the test's own checks."""
        counted = opcount.count_ops(name, fn)
        self._attach(opcount.PROPERTY_KEY, name, counted.to_json())
        return counted

    def record_counts(
        self,
        name: str,
        ops: dict[str, int],
        bytes_written: int = 0,
        allocations: int = 0,
        allocated_bytes: int = 0,
    ) -> opcount.OpCount:
        """Record counts the test obtained itself (a plan's launches per step kind, say)."""
        counted = opcount.OpCount(name, dict(ops), bytes_written, allocations, allocated_bytes)
        self._attach(opcount.PROPERTY_KEY, name, counted.to_json())
        return counted

    def _attach(self, key: str, name: str, value: dict[str, Any]) -> None:
        for k, v in self._node.user_properties:
            if k == key and v["name"] == name:
                raise ValueError(f"throughput name {name!r} recorded twice in {self._node.nodeid}")
        self._node.user_properties.append((key, dict(value, test=test_key(self._node.nodeid))))


@pytest.fixture
def throughput(request: pytest.FixtureRequest) -> ThroughputRecorder:
    """Record named throughput ratios (path vs. plain copy) for the baseline guard."""
    return ThroughputRecorder(request.node)


class ThroughputGuard:
    """Per-session collector (on the controller): gathers ratios and counts, saves, compares,
    reports."""

    def __init__(self, config: pytest.Config, tolerance: float, baseline: dict[str, Any] | None):
        self.config = config
        self.tolerance = tolerance
        self.baseline = baseline
        self.measurements: dict[str, dict[str, Any]] = {}
        self.counts: dict[str, dict[str, Any]] = {}
        self.comparisons: list[Comparison] = []
        self.count_changes: list[opcount.CountChange] = []
        self.counts_missing: list[tuple[str, str]] = []  # (name, "" or why excused)
        self.failed = False
        self.saved_to: str | None = None
        self.duplicates: list[str] = []
        #: Outcome of every test that reported in this run, by :func:`test_key`.
        self.outcomes: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.baseline is not None:  # outcomes only explain unmeasured baseline entries
            self._note_outcome(report)
        if report.when != "call" or not report.passed:
            return
        for key, value in report.user_properties:
            store = {PROPERTY_KEY: self.measurements, opcount.PROPERTY_KEY: self.counts}.get(key)
            if store is None:
                continue
            if value["name"] in store:
                self.duplicates.append(f"{value['name']} (again in {report.nodeid})")
                continue
            store[value["name"]] = value

    def _note_outcome(self, report: pytest.TestReport) -> None:
        """Keep the worst outcome of each test (failed > skipped > passed) by :func:`test_key`."""
        key = test_key(report.nodeid)
        if report.failed:
            self.outcomes[key] = f"failed in {report.when}"
        elif report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            reason = reason.removeprefix("Skipped: ")
            if not self.outcomes.get(key, "").startswith("failed"):
                self.outcomes[key] = f"skipped: {reason}"
        else:
            self.outcomes.setdefault(key, "passed without recording it")

    def excused(self, name: str) -> str:
        """Why a stored entry that was not measured does not fail the run ("" if it does):
        only when the test that measured it did not take part in this run at all."""
        source = (self.baseline or {}).get("sources", {}).get(name)
        if source is None:
            return ""  # the baseline does not say which test measures it
        if source in self.outcomes:
            return ""
        return f"{source} deselected or not collected"

    def unmeasured_reason(self, name: str) -> str:
        source = (self.baseline or {}).get("sources", {}).get(name)
        if source is None:
            return "the baseline names no test that measures it"
        return f"{source} {self.outcomes.get(source, 'did not run')}"

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        measured = {n: m["ratio"] for n, m in self.measurements.items()}
        counted = {n: c["fields"] for n, c in self.counts.items()}
        save = self.config.getoption("weightsync_save_baseline", None)
        if save:
            payload: dict[str, Any] = {
                "format": BASELINE_FORMAT,
                "ratios": dict(sorted(measured.items())),
                "tolerance": self.tolerance,
                "machine": machine_info(),
                "measurements": [self.measurements[n] for n in sorted(self.measurements)],
                "sources": {
                    n: v["test"]
                    for n, v in sorted({**self.measurements, **self.counts}.items())
                    if "test" in v
                },
            }
            if counted:
                payload["counts"] = dict(sorted(counted.items()))
            os.makedirs(os.path.dirname(os.path.abspath(save)), exist_ok=True)
            with open(save, "w") as f:
                json.dump(payload, f, indent=2, sort_keys=True)
                f.write("\n")
            self.saved_to = save
        if self.baseline is not None:
            if "ratios" in self.baseline:
                self.comparisons = compare(self.baseline["ratios"], measured, self.tolerance, self.excused)
            stored = self.baseline.get("counts")
            if stored is not None:
                for name, fields in sorted(stored.items()):
                    if name in counted:
                        self.count_changes += opcount.compare_counts(fields, counted[name], name)
                    else:
                        self.counts_missing.append((name, self.excused(name)))
            self.failed = (
                any(c.failed for c in self.comparisons)
                or any(c.worse for c in self.count_changes)
                or any(not why for _, why in self.counts_missing)
            )
        if self.duplicates:
            self.failed = True
        if self.failed and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        tr = terminalreporter
        if self.measurements:
            tr.write_sep("-", "weightsync throughput (ratio = path GB/s / plain-copy GB/s, same run)")
            cells = [
                (
                    n,
                    m["device"],
                    f"{m['nbytes'] / 2**20:.1f}",
                    f"{m['path_gbps']:.2f}",
                    f"{m['copy_gbps']:.2f}",
                    f"{m['ratio']:.3f}",
                )
                for n, m in sorted(self.measurements.items())
            ]
            for line in text_table(("name", "device", "MiB", "path GB/s", "copy GB/s", "ratio"), cells):
                tr.write_line(line)
        if self.counts:
            tr.write_sep("-", "weightsync op counts (per call)")
            cells = []
            for n, c in sorted(self.counts.items()):
                f = c["fields"]
                ops = ", ".join(f"{k[3:]} x{v}" for k, v in f.items() if k.startswith("op:"))
                cells.append((n, ops or "-", f["bytes_written"], f["allocations"], f["allocated_bytes"]))
            for line in text_table(("name", "ops", "bytes written", "allocations", "allocated bytes"), cells):
                tr.write_line(line)
        if self.duplicates:
            tr.write_line(
                "throughput names recorded by more than one test (names must be unique): "
                + ", ".join(self.duplicates),
                red=True,
            )
        if self.saved_to:
            tr.write_line(f"weightsync throughput baseline written to {self.saved_to}")
        if self.comparisons or self.count_changes or self.counts_missing or self.failed:
            title = (
                "weightsync throughput REGRESSION"
                if self.failed
                else "weightsync throughput vs baseline"
            )
            tr.write_sep("=" if self.failed else "-", title, red=self.failed, bold=self.failed)
            if self.comparisons:
                for line in comparison_table(self.comparisons):
                    tr.write_line(line)
            missing = [c.name for c in self.comparisons if c.status == "NOT MEASURED"]
            missing += [n for n, why in self.counts_missing if not why]
            for name in missing:
                tr.write_line(f"baseline entry {name} was not measured: {self.unmeasured_reason(name)}", red=True)
            excused = [c for c in self.comparisons if c.status.startswith("not run")]
            if excused or any(why for _, why in self.counts_missing):
                names = [c.name for c in excused] + [n for n, why in self.counts_missing if why]
                tr.write_line(f"baseline entries not run (their tests were deselected): {', '.join(names)}", yellow=True)
            new = [c.name for c in self.comparisons if c.status == "new"]
            if self.baseline is not None and "counts" in self.baseline:
                new += [n for n in self.counts if n not in self.baseline["counts"]]
            if new:
                tr.write_line(
                    f"measured entries absent from the baseline: {', '.join(new)}", yellow=True
                )
            if self.count_changes:
                rows = [
                    (c.name, c.field, c.baseline, c.measured,
                     "MORE" if c.worse else "fewer (update the baseline)")
                    for c in self.count_changes
                ]
                for line in text_table(("name", "count", "baseline", "measured", "status"), rows):
                    tr.write_line(line, red=any(c.worse for c in self.count_changes))
            if any(c.status == "REGRESSED" for c in self.comparisons):
                tr.write_line(
                    f"a throughput ratio dropped by more than the tolerance "
                    f"({self.tolerance:.0%}); the run fails",
                    red=True,
                )
            if any(c.worse for c in self.count_changes):
                tr.write_line(
                    "a path now does more per call than the baseline records (counts are exact); "
                    "the run fails",
                    red=True,
                )
