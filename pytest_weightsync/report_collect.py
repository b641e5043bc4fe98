"""The run's conformance report on the controller: every tagged test's reports collected
into outcomes, the run's selection, each implementation's verdict and the exit status.

:mod:`pytest_weightsync.report` tags the tests and registers one :class:`ConformanceReport`
per session; the outputs are mixins, the terminal matrix (:mod:`.report_matrix`) and the
JSON report (:mod:`.report_json`), the speed cells and plot :mod:`.speed_column`. This module
holds what they all read: the collecting hooks, the selection, the verdicts and the
aggregates (cells, speed profiles, findings, bucket limits, what tests left behind).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

from pytest_weightsync import speed_column
from pytest_weightsync import verdict as verdicts
from pytest_weightsync.report_json import JsonReport
from pytest_weightsync.report_matrix import MatrixLines
from pytest_weightsync.report_results import (
    BUCKET_KEYS,
    COVERAGE_KEYS,
    ENGINE,
    FINDING_KEYS,
    KEYS,
    LEFT_BEHIND,
    MAX_MESSAGE,
    PREFIX,
    TestResult,
    cut,
)
from pytest_weightsync.selection import Selection, SelectionRecorder, WorkerSelections
from pytest_weightsync.vocabulary import (
    BUCKET_LIMIT,
    HARDENING,
    NOT_RUN,
    PASS,
    PROPERTIES,
    REPORT_PROPERTIES,
    SPEED,
    WAIVED,
)

__all__ = ["ConformanceReport"]

#: The detail of every verdict of a --collect-only run.
COLLECT_ONLY = "--collect-only: no test ran"


class ConformanceReport(MatrixLines, JsonReport):
    """Outcomes of every tagged test, the run's selection, and what they add up to."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.results: dict[str, TestResult] = {}
        self.started = time.time()
        self.finished: Optional[float] = None
        self.interrupted: Optional[str] = None
        self.collection_errors: list[dict] = []
        self.recorder = SelectionRecorder(config)
        self.workers = WorkerSelections()
        self._verdicts: Optional[dict] = None
        #: implementation -> the engine it says it is (``_engine``), from its tests' reports
        self.engines: dict[str, dict] = {}
        self.exitstatus: Optional[int] = None
        #: The exit status pytest gives the interruption (set when it is reported).
        self.interrupt_status: Optional[int] = None
        #: the speed column drawn beside the JSON report (``speed_column.write_plot``)
        self.speed_plot = None

    # -- hooks -----------------------------------------------------------------------------

    def pytest_runtest_logreport(self, report) -> None:
        props = [(k[len(PREFIX):], v) for k, v in getattr(report, "user_properties", ())
                 if isinstance(k, str) and k.startswith(PREFIX)]
        tags = {k: v for k, v in props if k in KEYS}  # a run-time value overrides a tag
        if not tags:
            return
        result = self.results.get(report.nodeid)
        if result is None:
            result = self.results[report.nodeid] = TestResult(report.nodeid, tags)
        result.tags.update(tags)
        result.finding.update({k: str(v) for k, v in props if k in FINDING_KEYS + BUCKET_KEYS
                               + COVERAGE_KEYS + (LEFT_BEHIND,)})
        for k, v in props:
            if k == "skip":
                result.skip_kind = str(v)
            elif k == "file":
                result.file = str(v)
            elif k == "waived":
                result.waived = str(v)
            elif k == "located":
                result.located = True
            elif k == ENGINE and tags.get("implementation"):
                try:
                    self.engines[tags["implementation"]] = json.loads(v)
                except (TypeError, ValueError):
                    pass
            elif k == "speed":
                try:
                    result.speed.update(json.loads(v) if isinstance(v, str) else dict(v))
                except (TypeError, ValueError):
                    pass
        result.update(report)

    def pytest_collectreport(self, report) -> None:
        if report.failed:
            self.collection_errors.append({"nodeid": report.nodeid,
                                           "message": cut(str(report.longrepr), MAX_MESSAGE)})

    @pytest.hookimpl(tryfirst=True)
    def pytest_keyboard_interrupt(self, excinfo) -> None:
        """First of all: pytest's own handler formats the traceback next, and a second Ctrl-C
        while it does ends the handling before pytest sets the exit status."""
        self.interrupted = f"interrupted: {excinfo.typename}"
        code = getattr(excinfo.value, "returncode", None)  # pytest.exit(returncode=...)
        self.interrupt_status = int(pytest.ExitCode.INTERRUPTED) if code is None else int(code)

    def collect_only(self) -> bool:
        return bool(self.config.getoption("collectonly", False))

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session, exitstatus) -> None:
        self.finished = time.time()
        status = int(exitstatus)
        pending = sys.exc_info()[1]  # an interruption on its way out of pytest's main loop
        if self.interrupt_status is None and isinstance(pending, KeyboardInterrupt):
            self.interrupted = f"interrupted: {type(pending).__name__}"
            self.interrupt_status = int(pytest.ExitCode.INTERRUPTED)
        if self.interrupt_status is not None and status == int(pytest.ExitCode.OK):
            status = self.interrupt_status
            session.exitstatus = status
        self.exitstatus = status
        if self.interrupted is None and (session.shouldstop or session.shouldfail):
            self.interrupted = f"stopped early: {session.shouldstop or session.shouldfail}"
        if self.interrupted is None and status == int(pytest.ExitCode.INTERRUPTED):
            self.interrupted = "interrupted"
        self._verdicts = None
        judged = self.verdicts()
        # a waived deviation was accepted by the team's own file: reported, not failed
        not_pass = {name: v for name, v in judged.items() if v.word not in (PASS, WAIVED)}
        allow = self.config.getoption("weightsync_allow_partial", False)
        if (not_pass and status == int(pytest.ExitCode.OK) and not allow
                and not self.collect_only()):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
            self.exitstatus = int(session.exitstatus)
            self.exit_note = (f"weightsync: exit status {int(session.exitstatus)}: "
                              + ", ".join(f"{n} {v}" for n, v in sorted(not_pass.items()))
                              + " (a verdict other than PASS certifies nothing; "
                                "--weightsync-allow-partial accepts it)")
        path = self.config.getoption("weightsync_report", None)
        if path:  # written even when no tagged test ran: a CI step may read it unconditionally
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.speed_plot = speed_column.write_plot(self.speed(), path)
            Path(path).write_text(json.dumps(self.to_json(), indent=2, sort_keys=False) + "\n")

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.collect_only() and (self.results or self.selection().implementations()):
            for line in self.matrix_lines():
                terminalreporter.write_line(line)
        note = getattr(self, "exit_note", None)
        if note:
            terminalreporter.write_line(note)
        path = self.config.getoption("weightsync_report", None)
        if path:
            terminalreporter.write_line(f"weightsync: conformance report written to {path}")
        if self.speed_plot is not None:
            terminalreporter.write_line(f"weightsync: speed column plotted in {self.speed_plot}")

    # -- the selection and the verdicts ------------------------------------------------------

    def _controller(self) -> bool:
        return self.config.pluginmanager.getplugin("dsession") is not None

    def selection(self) -> Selection:
        if self._controller():
            return self.workers.selection() or Selection()
        return self.recorder.selection

    def selection_known(self) -> bool:
        return not self._controller() or self.workers.selection() is not None

    def verdicts(self) -> dict:
        """``{implementation: Verdict}`` of every implementation with tests in this run."""
        if self._verdicts is not None:
            return self._verdicts
        selection = self.selection()
        known = self.selection_known()
        impls = sorted({r.tags["implementation"] for r in self.conformance()}
                       | set(selection.implementations()))
        if self.collect_only():
            self._verdicts = {impl: verdicts.Verdict(
                NOT_RUN, total=len(selection.selected.get(impl, ()))
                + selection.deselected.get(impl, 0), details=[COLLECT_ONLY]) for impl in impls}
            return self._verdicts
        out = {}
        for impl in impls:
            outcomes = [verdicts.Outcome(r.nodeid, r.outcome, r.skip_kind, r.waived or r.message,
                                         counts=r.tags.get("property") not in REPORT_PROPERTIES,
                                         prop=r.tags.get("property"))
                        for r in self.conformance() if r.tags["implementation"] == impl]
            selected = selection.selected.get(impl, []) if known and impl in selection.roles \
                else None
            out[impl] = verdicts.decide(
                outcomes, selected=selected, deselected=selection.deselected.get(impl, 0),
                missing_modules=selection.missing_modules(impl) if known else (),
                interrupted=self.interrupted is not None, selection_known=known)
        self._verdicts = out
        return out

    def verdict(self, impl: str, cells: Optional[dict] = None) -> str:
        """The verdict text of ``impl`` (``PASS``, ``FAIL (...)``, ``PARTIAL (...)``, ...)."""
        judged = self.verdicts().get(impl)
        return str(judged) if judged is not None else "NOT RUN (no test)"

    # -- aggregation -----------------------------------------------------------------------

    def conformance(self) -> list[TestResult]:
        """Tests that ran against a registered implementation."""
        return [r for r in self.results.values() if "implementation" in r.tags]

    def cells(self) -> dict[tuple, list[TestResult]]:
        """``(implementation, property, topology) -> tests``."""
        out: dict[tuple, list[TestResult]] = {}
        for r in self.conformance():
            key = (r.tags["implementation"], r.tags.get("property", "-"),
                   r.tags.get("topology", "-"))
            out.setdefault(key, []).append(r)
        return out

    def _axes(self):
        cells = self.cells()
        impls = sorted({k[0] for k in cells} | set(self.selection().implementations()))
        props = sorted({k[1] for k in cells}, key=self._property_order)
        topos = sorted({k[2] for k in cells})
        return cells, impls, props, topos

    @staticmethod
    def _property_order(name: str):
        known = tuple(p for p in PROPERTIES if p not in REPORT_PROPERTIES)
        if name in REPORT_PROPERTIES:
            return (2, REPORT_PROPERTIES.index(name), name)
        return (0, known.index(name), name) if name in known else (1, 0, name)

    def speed(self) -> dict:
        """``{implementation: {format: profile}}`` recorded by the speed tests that passed."""
        out: dict = {}
        for r in self.conformance():
            if r.tags.get("property") == SPEED and r.outcome == "passed" and r.speed:
                fmt = r.speed.get("format", r.tags.get("format", "-"))
                out.setdefault(r.tags["implementation"], {}).setdefault(fmt, {}).update(
                    {k: v for k, v in r.speed.items() if k != "format"})
        return out

    def findings(self) -> dict:
        """``{implementation: {(format, kind): {finding: {"topologies": [...], "detail": the
        first message head}}}}`` of the hardening tests that recorded a finding, in node-id
        order (not completion order: under xdist the report must not depend on which worker
        finished first)."""
        out: dict = {}
        for r in sorted(self.conformance(), key=lambda r: r.nodeid):
            if r.tags.get("property") != HARDENING or "finding" not in r.finding:
                continue
            key = (r.tags.get("format", "-"), r.finding.get("bad_kind", "-"))
            by_text = out.setdefault(r.tags["implementation"], {}).setdefault(key, {})
            entry = by_text.setdefault(r.finding["finding"], {"topologies": [], "detail": ""})
            entry["topologies"].append(r.tags.get("topology", "-"))
            entry["detail"] = entry["detail"] or r.finding.get("finding_detail", "")
        return out

    def bucket_limits(self) -> dict:
        """``{implementation: [{"topology", "nodeid", "finding", "detail"}]}`` of the tests
        that recorded a :data:`BUCKET_LIMIT` finding, in run order."""
        out: dict = {}
        for r in self.conformance():
            if BUCKET_LIMIT not in r.finding:
                continue
            out.setdefault(r.tags["implementation"], []).append({
                "topology": r.tags.get("topology", "-"), "nodeid": r.nodeid,
                "finding": r.finding[BUCKET_LIMIT],
                "detail": r.finding.get(f"{BUCKET_LIMIT}_detail", "")})
        return out

    def left_behind(self) -> dict:
        """``{implementation: [{"nodeid", "what"}]}``: what its tests left in the pytest
        process (threads, processes, torch settings, environment, memory), in run order."""
        out: dict = {}
        for r in self.conformance():
            if LEFT_BEHIND in r.finding:
                out.setdefault(r.tags["implementation"], []).append(
                    {"nodeid": r.nodeid, "what": r.finding[LEFT_BEHIND]})
        return out
