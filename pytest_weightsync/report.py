"""The conformance matrix: implementation x property x topology, in the terminal, as JSON
(``--weightsync-report PATH``) and as junit properties, with each implementation's verdict.

Tagging happens at collection: every test that checks a property (marker
``weightsync_property(name)``) or runs against a registered implementation gets
``item.user_properties`` entries naming its implementation, property, topology, payload
format and backend (marker ``weightsync_backend(name)``). pytest's ``--junitxml`` writes
``user_properties`` as ``<property>`` elements, and pytest-xdist forwards them with every
report, so the matrix is built on the controller from reports alone
(``pytest_runtest_logreport``), never from items - it works the same under ``-n``.

Verdicts (:mod:`pytest_weightsync.verdict`) count every conformance property but
:data:`HARDENING`, and certify only what ran: the run's selection
(:mod:`pytest_weightsync.selection`) says which of an implementation's tests were selected,
deselected or never collected, and a test counts only once its call phase reported; a
property the implementation has whose every case lay outside its declared topologies is named
NOT RUN, and the JSON counts per property the cases its claims selected and how many ran
(``cases``). A run whose verdicts are not all PASS exits non-zero even when no test failed
(PARTIAL, NOT RUN), unless ``--weightsync-allow-partial`` is given. The failure shown first per
implementation and property is a located difference where the run produced one (a skip kind
and a ``located`` flag are recorded where the test ran, from its exception). :data:`HARDENING` is a report: its tests
record a finding per bad kind (``weightsync_record_property("weightsync_finding", ...)``) and
are listed per implementation, never counted in the verdict (a hardening test that fails - a
loader that refused a bucket after writing part of it - is a conformance failure and does
count).
:data:`BUCKET_LIMIT` is a report-only column too: every distributed-export test with a bucket
limit records whether its buckets kept the rule (``within``: none exceeds ``bucket_bytes`` by
more than one unit) or not (``over``, with the first offending bucket); the column shows
``within k/n`` per implementation and the buckets over are listed below the matrix.

Every message the plugin writes is cut: a failing test's pytest report (terminal, junit) to
:data:`MAX_LONGREPR` characters, messages in the JSON and the matrix to :data:`MAX_MESSAGE`.

A property a test finds at run time (a hardening finding, a speed profile, a bucket-limit
finding) is recorded with the :func:`weightsync_record_property` fixture, not pytest's
``record_property``, which warns on every test that asks for it under pytest's default junit
family (xunit2); both add to the test's ``user_properties``.

A ``--collect-only`` run prints no matrix and keeps its exit status: it runs nothing, so every
verdict is NOT RUN (in the JSON report). An interrupted run (Ctrl-C, SIGTERM, ``pytest.exit``)
reports pytest's exit status for it (2 for Ctrl-C) and is never turned into a failed one, even
when a second Ctrl-C cut pytest's own handling of the first short.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
import textwrap
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

import pytest

from pytest_weightsync import claimed, speed_column, topology, waivers
from pytest_weightsync import verdict as verdicts
from pytest_weightsync.registry import (
    USAGE_ERROR,
    declared_registry,
    implementation_of,
    optional_names,
    registered_of,
)
from pytest_weightsync.selection import Selection, SelectionRecorder, WorkerSelections
from pytest_weightsync.vocabulary import (
    BUCKET_LIMIT,
    BUCKET_WITHIN,
    FORMAT_PARAMS,
    HARDENING,
    NOT_RUN,
    OUTCOME_WAIVED,
    PASS,
    PROPERTIES,
    RANKS_COVERED,
    REPORT_PROPERTIES,
    SKIP_OUTSIDE,
    SKIP_UNCLAIMED,
    SPEED,
    VERDICTS,
    WAIVED,
)

PREFIX = "weightsync_"
KEYS = ("implementation", "property", "topology", "format", "backend")
#: What a test or a cell counts as, worst first.
OUTCOMES = ("failed", OUTCOME_WAIVED, "passed", "skipped")
#: Longest failure message kept per test in the matrix and the JSON.
MAX_MESSAGE = 4000
#: Longest pytest failure report (terminal, junit) of a tagged test.
MAX_LONGREPR = 20000
#: user_properties keys the hardening probe records at run time.
FINDING_KEYS = ("bad_kind", "finding", "finding_detail")
#: user_properties keys a distributed-export test records for the bucket-limit column.
BUCKET_KEYS = (BUCKET_LIMIT, f"{BUCKET_LIMIT}_detail")
#: user_properties key of the engine family and version an implementation says it is.
ENGINE = "engine"
#: user_properties key of what a test left in the pytest process (process_hygiene).
LEFT_BEHIND = "left_behind"
#: user_properties keys a coverage_by_rank test records: the engine ranks its check covered.
COVERAGE_KEYS = (RANKS_COVERED,)
MAX_DETAIL = 100
#: The detail of every verdict of a --collect-only run.
COLLECT_ONLY = "--collect-only: no test ran"
#: Versions of these distributions go into the JSON report (read from metadata, no import).
VERSIONED = ("pytest-weightsync", "pytest", "pytest-xdist", "hypothesis", "torch", "sglang",
             "megatron-core", "megatron-bridge", "transformer-engine")
FORMAT_VERSION = 6
#: Widest terminal line of the matrix tables (details are listed under them).
MATRIX_WIDTH = 120


def cut(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters, keeping its head and tail."""
    if len(text) <= limit:
        return text
    head, tail = (limit * 3) // 4, limit // 4
    return f"{text[:head]}\n... [{len(text) - head - tail} characters cut] ...\n{text[-tail:]}"


def _marker_arg(item: pytest.Item, name: str) -> Optional[str]:
    marker = item.get_closest_marker(name)
    if marker is None:
        return None
    value = marker.args[0] if marker.args else marker.kwargs.get("name")
    return None if value is None else str(value)


def _topology_of(item: pytest.Item) -> Optional[str]:
    """The id of a topology-matrix case among the test's parameters (anything with ``spec``,
    ``receiver`` and a string ``id``, like ``suites.harness.cases.Case`` / ``DistCase``)."""
    case = topology.topology_of(item)
    return None if case is None else case.id


def tags_of(item: pytest.Item) -> dict:
    """``{key: value}`` of the report keys that apply to ``item`` (empty: not a suite test)."""
    tags = {
        "implementation": implementation_of(item),
        "property": _marker_arg(item, "weightsync_property"),
        "backend": _marker_arg(item, "weightsync_backend"),
        "topology": _topology_of(item),
    }
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        for param in FORMAT_PARAMS:
            if isinstance(callspec.params.get(param), str):
                tags["format"] = callspec.params[param]
                break
    if tags["implementation"] is None and tags["property"] is None:
        return {}
    return {k: v for k, v in tags.items() if v is not None}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list) -> None:
    for item in items:
        present = {key for key, _ in item.user_properties}
        tags = tags_of(item)
        for key, value in tags.items():
            if PREFIX + key not in present:
                item.user_properties.append((PREFIX + key, value))
        if tags.get("implementation") and PREFIX + "file" not in present:
            # where the test lives, for a rerun command (a --pyargs node id is relative to
            # the package, not to where pytest runs)
            item.user_properties.append((PREFIX + "file", str(item.path)))
        if tags.get("implementation") and PREFIX + ENGINE not in present:
            entry = registered_of(item)  # the engine travels with the reports (xdist)
            engine = _engine(entry.obj) if entry is not None else None
            if engine is not None:
                item.user_properties.append((PREFIX + ENGINE, json.dumps(engine)))


@pytest.fixture
def weightsync_record_property(request: pytest.FixtureRequest):
    """``record(name, value)``: add a property to the calling test's report, for the matrix
    and the JSON report (and ``--junitxml``, which writes it; xdist forwards it). It is what
    pytest's ``record_property`` does, without the warning that fixture gives on every test
    that requests it under the default junit family (xunit2)."""

    def record(name: str, value: object) -> None:
        request.node.user_properties.append((name, value))

    return record


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Where the test ran (the pytest process or an xdist worker): name the kind of a skip
    (``weightsync_skip``: not claimed / not applicable / not run) and cut a huge failure
    report before pytest prints it, writes it to junit or ships it to the controller."""
    outcome = yield
    report = outcome.get_result()
    if not any(k.startswith(PREFIX) for k, _ in item.user_properties):
        return
    if report.skipped and call.excinfo is not None:
        kind = getattr(call.excinfo.value, "kind", None)
        if kind == SKIP_OUTSIDE and _property_unclaimed(item):
            kind = SKIP_UNCLAIMED  # a case of a property the implementation does not have
        if isinstance(kind, str):
            report.user_properties.append((PREFIX + "skip", kind))
    if report.failed and call.excinfo is not None and _located(call.excinfo.value):
        report.user_properties.append((PREFIX + "located", "1"))
    if report.failed and report.longrepr is not None:
        text = str(report.longrepr)
        if len(text) > MAX_LONGREPR:
            report.longrepr = cut(text, MAX_LONGREPR)


def _located(error: BaseException) -> bool:
    """Whether a failure is a located difference: the suites' conformance errors and
    ``compare``'s bit mismatches carry the first differing element's ``location``."""
    try:
        return getattr(error, "location", None) is not None
    except Exception:  # a third-party exception's property must not break the report
        return False


def _property_unclaimed(item) -> bool:
    """Whether ``item``'s implementation does not have ``item``'s property at all (a test may
    refuse its case before it asks whether the property is claimed: the lifecycle tests look
    at the topology first)."""
    entry = registered_of(item)
    if entry is None:
        return False
    try:
        return claimed.property_refusal(entry.obj.capabilities,
                                       _marker_arg(item, "weightsync_property")) is not None
    except Exception:  # third-party capabilities must not break the report
        return False


# --------------------------------------------------------------------------------------------
# Collecting outcomes from reports
# --------------------------------------------------------------------------------------------


@dataclass
class TestResult:
    """One tagged test as its reports tell it. ``outcome`` starts as ``not run`` and becomes
    ``passed`` only when the call phase passed (a setup that passed is not a result)."""

    __test__ = False  # not a pytest test class

    nodeid: str
    tags: dict
    outcome: str = "not run"
    message: str = ""
    skip_kind: Optional[str] = None
    phases: set = field(default_factory=set)
    finding: dict = field(default_factory=dict)
    duration: float = 0.0
    location: Optional[tuple] = None
    file: Optional[str] = None
    speed: dict = field(default_factory=dict)
    #: the reason of the waiver that accepted this test's failure (``waivers``), if one did
    waived: Optional[str] = None
    #: whether its failure is a located difference (the first wrong element found and named)
    located: bool = False

    def update(self, report) -> None:
        self.phases.add(report.when)
        self.duration += float(getattr(report, "duration", 0.0) or 0.0)
        self.location = self.location or getattr(report, "location", None)
        if report.failed:
            if self.outcome != "failed":
                self.message = _failure_message(report)
            self.outcome = "failed"
        elif self.waived and report.when == "call" and self.outcome != "failed":
            self.outcome = OUTCOME_WAIVED
            self.message = _failure_message(report)
        elif report.skipped and self.outcome != "failed":
            self.outcome = "skipped"
            self.message = _skip_reason(report)
        elif report.when == "call" and report.passed and self.outcome == "not run":
            self.outcome = "passed"

    @property
    def ran(self) -> bool:
        return self.outcome != "not run"


def first_failure(failed: list) -> "TestResult":
    """The failure to show first of ``failed`` (in run order): the first located difference
    (it names the wrong element and, where it recognizes it, the bug), else the first - a
    loader's raw exception on one rank says less than the located diff the same run found."""
    return next((t for t in failed if t.located), failed[0])


def _failure_message(report) -> str:
    longrepr = report.longrepr
    crash = getattr(longrepr, "reprcrash", None)
    text = getattr(crash, "message", None) or getattr(report, "longreprtext", "") or str(longrepr)
    if report.when != "call":
        text = f"error in {report.when}: {text}"
    return cut(text, MAX_MESSAGE)


#: The exception name pytest puts before a skip's reason (``Skipped: ...``, or a skip kind's
#: own class, ``NotClaimed: ...``).
_SKIP_PREFIX = re.compile(r"^(?:[\w.]+\.)?(?:Skipped|NotClaimed|OutsideClaims|NotApplicable|NoDevice"
                          r"|CutOff): ")


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return cut(_SKIP_PREFIX.sub("", str(longrepr[2]), count=1), MAX_MESSAGE)
    return cut(str(longrepr or ""), MAX_MESSAGE)


def _topologies(n: int) -> str:
    return f"{n} topology" if n == 1 else f"{n} topologies"


def _worst(outcomes) -> str:
    outcomes = set(outcomes)
    for outcome in OUTCOMES:
        if outcome in outcomes:
            return outcome
    return "not run" if "not run" in outcomes else "skipped"


def _topology_outcomes(cells: dict, impl: str, prop: str) -> Counter:
    """How many topologies of ``impl`` x ``prop`` passed, failed, were skipped or did not
    run; a topology counts as the worst outcome among its tests."""
    return Counter(_worst(t.outcome for t in tests)
                   for (i, p, _), tests in cells.items() if i == impl and p == prop)


def _versions() -> dict:
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _engine(obj) -> Optional[dict]:
    """The engine an implementation says it is: its ``engine`` attribute, a mapping with a
    ``family`` (``"sglang"``, ``"vllm"``, an engine speaking one of their update APIs) and a
    ``version``; ``None`` for one that says nothing (a loader of no particular engine)."""
    try:
        engine = getattr(obj, "engine", None)
        family = engine.get("family") if isinstance(engine, Mapping) else None
        if not isinstance(family, str) or not family:
            return None
        version = engine.get("version")
        return {"family": family, "version": None if version is None else str(version)}
    except Exception:  # third-party attribute access must not break the report
        return None


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


class ConformanceReport:
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

    @staticmethod
    def _bucket_cell(entries) -> str:
        """``within k/n``: of the n tests with a bucket limit, k kept the one-unit rule."""
        if not entries:
            return "-"
        within = sum(1 for e in entries if e["finding"] == BUCKET_WITHIN)
        return f"{BUCKET_WITHIN} {within}/{len(entries)}"

    @staticmethod
    def _hardening_cell(by_key: dict) -> str:
        """``refused k/n``: of the (format, kind) probes that ran, how many were refused on
        every topology."""
        if not by_key:
            return "not run"
        refused = sum(1 for texts in by_key.values()
                      if all(t.startswith("refused") and not t.startswith("refused after")
                             for t in texts))
        return f"refused {refused}/{len(by_key)}"

    def _cell_text(self, cells, impl, prop, findings, speed=None) -> str:
        c = _topology_outcomes(cells, impl, prop)
        if not c:
            return "-"
        if prop == SPEED:
            text = speed_column.cell(impl, speed if speed is not None else self.speed())
            return f"{text}, {c['failed']} failed" if c["failed"] else text
        if prop == HARDENING:
            text = self._hardening_cell(findings.get(impl, {}))
            return f"{text}, {c['failed']} failed" if c["failed"] else text
        if not c["passed"] and not c["failed"] and not c[OUTCOME_WAIVED]:
            return "not run"
        text = f"{c['passed']}/{c['failed']}/{c['skipped'] + c['not run']}"
        return f"{text} {c[OUTCOME_WAIVED]} {WAIVED}" if c[OUTCOME_WAIVED] else text

    def rerun_command(self, result: TestResult) -> str:
        """A shell command that reruns exactly ``result``'s test against its implementation,
        from the directory pytest was started in."""
        invocation = self.config.invocation_params
        path, sep, rest = result.nodeid.partition("::")
        file = result.file or str((self.config.rootpath / path).resolve())
        target = file + sep + rest
        args = ["-p", "weightsync"]
        given = list(invocation.args)
        for i, arg in enumerate(given):
            if arg == "-p" and i + 1 < len(given) and given[i + 1] != "weightsync":
                args += ["-p", given[i + 1]]
            elif arg.startswith("-p") and len(arg) > 2 and arg[2:] != "weightsync":
                args += ["-p", arg[2:]]
        for option, flag in (("weightsync_loader", "--weightsync-loader"),
                             ("weightsync_eligibility", "--weightsync-eligibility")):
            for value in self.config.getoption(option, None) or ():
                args += [flag, value]
        for option, flag in (("weightsync_call_timeout", "--weightsync-call-timeout"),
                             ("weightsync_rank_timeout", "--weightsync-rank-timeout")):
            value = self.config.getoption(option, None)
            if value is not None:
                args += [flag, str(value)]
        args += ["--weightsync-only", result.tags["implementation"], "--weightsync-allow-partial"]
        python = shlex.quote(sys.executable)
        return (f"cd {shlex.quote(str(invocation.dir))} && {python} -m pytest "
                + " ".join(shlex.quote(a) for a in [*args, target]))

    def matrix_lines(self) -> list[str]:
        cells, impls, props, topos = self._axes()
        lines = []
        if impls:
            findings = self.findings()
            lines.append("=" * 20 + " weightsync conformance matrix " + "=" * 20)
            lines += textwrap.wrap(
                f"cells: topologies passed / failed / skipped (of {len(topos)} topologies; a "
                f"topology fails when any of its tests fails; 'not run': no case ran; "
                f"'{NOT_RUN}': claimed, but no case fits the implementation's topologies). The "
                f"verdict counts every property but {' and '.join(REPORT_PROPERTIES)} "
                f"(reports), and only what ran: one of {', '.join(VERDICTS)}.", MATRIX_WIDTH)
            speed = self.speed()
            cell_text = {(impl, p): self._cell_text(cells, impl, p, findings, speed)
                         for impl in impls for p in props}
            for impl, judged in self.verdicts().items():
                for p in judged.unrun:  # claimed, no case fitted: not the "not run" of a
                    cell_text[impl, p] = NOT_RUN  # property it does not claim
            buckets = self.bucket_limits()
            columns = list(props)
            if buckets:  # a report-only column, after the properties
                columns.append(BUCKET_LIMIT)
                for impl in impls:
                    cell_text[impl, BUCKET_LIMIT] = self._bucket_cell(buckets.get(impl))
            lines += self._table_lines(impls, columns, cell_text)
            if self.interrupted:
                lines.append(f"the run was {self.interrupted}: tests without a result are not "
                             f"counted as passed")
            failures = [t for t in self.conformance() if t.outcome == "failed"]
            if failures:
                lines.append(f"failures ({len(failures)} tests; first per implementation and "
                             f"property, a located difference before a raw exception, with "
                             f"the command that reruns it):")
                by_key: dict = {}
                for t in failures:
                    by_key.setdefault((t.tags["implementation"], t.tags.get("property")),
                                      []).append(t)
                for key, tests in by_key.items():
                    t = first_failure(tests)
                    head = t.message.strip().splitlines()[0] if t.message.strip() else "(no message)"
                    lines.append(f"  {key[0]} / {key[1]} / {t.tags.get('topology', '-')}: "
                                 f"{cut(head, 300)}")
                    lines.append(f"    rerun: {self.rerun_command(t)}")
            waived = waivers.of(self.config)
            lines += waived.lines() if waived is not None else []
            lines += speed_column.lines(speed)
            lines += self.hardening_lines(findings)
            lines += self.bucket_limit_lines(buckets)
            lines += self.left_behind_lines()
        lines += self.footer_lines()
        return lines

    def left_behind(self) -> dict:
        """``{implementation: [{"nodeid", "what"}]}``: what its tests left in the pytest
        process (threads, processes, torch settings, environment, memory), in run order."""
        out: dict = {}
        for r in self.conformance():
            if LEFT_BEHIND in r.finding:
                out.setdefault(r.tags["implementation"], []).append(
                    {"nodeid": r.nodeid, "what": r.finding[LEFT_BEHIND]})
        return out

    def left_behind_lines(self) -> list[str]:
        """Per test, what it left in the pytest process (the warnings say it too, but they
        are easy to miss below a long run)."""
        left = self.left_behind()
        if not left:
            return []
        lines = ["left behind in the pytest process (after the test; "
                 "-W error::pytest_weightsync.process_hygiene.ImplementationLeakWarning fails it):"]
        for impl in sorted(left):
            for entry in left[impl]:
                lines.append(f"  {entry['nodeid']}: {cut(entry['what'], 300)}")
        return lines

    def _table_lines(self, impls, columns, cell_text) -> list[str]:
        """The matrix in at most :data:`MATRIX_WIDTH` columns: one table when it fits, else
        the property columns in consecutive tables, the last ending with each verdict's word
        and the whole verdicts listed under it."""
        verdict = {impl: self.verdict(impl) for impl in impls}
        judged = self.verdicts()
        word = {impl: judged[impl].word if impl in judged else NOT_RUN for impl in impls}
        first = max([len("implementation")] + [len(i) for i in impls])
        widths = [max(len(p), max(len(cell_text[i, p]) for i in impls)) for p in columns]

        def table(group, last: bool, verdicts: dict) -> list[str]:
            tail = ["verdict"] if last else []
            out = ["  ".join([f"{'implementation':<{first}}"]
                             + [f"{p:>{w}}" for p, w in group] + tail).rstrip()]
            for impl in impls:
                row = [f"{impl:<{first}}"] + [f"{cell_text[impl, p]:>{w}}" for p, w in group]
                out.append("  ".join(row + ([verdicts[impl]] if last else [])).rstrip())
            return out

        pairs = list(zip(columns, widths))
        whole = first + sum(2 + w for w in widths) + 2 + max(len(v) for v in verdict.values())
        if whole <= MATRIX_WIDTH:
            return table(pairs, True, verdict)
        room = MATRIX_WIDTH - 2 - max(len("verdict"), max(len(w) for w in word.values()))
        groups, current, used = [], [], first
        for p, w in pairs:
            if current and used + 2 + w > room:
                groups.append(current)
                current, used = [], first
            current.append((p, w))
            used += 2 + w
        groups.append(current)
        lines = []
        for index, group in enumerate(groups):
            lines += table(group, index == len(groups) - 1, word)
        lines.append("verdicts:")
        for impl in impls:
            lines += textwrap.wrap(f"{impl}: {verdict[impl]}", MATRIX_WIDTH,
                                   initial_indent="  ", subsequent_indent="    ")
        return lines

    @staticmethod
    def bucket_limit_lines(buckets: dict) -> list[str]:
        """Per implementation, each test whose buckets exceed the limit by more than a unit."""
        over = {impl: [e for e in entries if e["finding"] != BUCKET_WITHIN]
                for impl, entries in buckets.items()}
        over = {impl: entries for impl, entries in over.items() if entries}
        if not over:
            return []
        lines = [f"{BUCKET_LIMIT} (a bucket may exceed bucket_bytes by one unit, the tensors "
                 f"converted from one source parameter; findings, not verdicts):"]
        for impl in sorted(over):
            for entry in over[impl]:
                lines.append(f"  {impl} / {entry['topology']}: {cut(entry['detail'], 300)}")
        return lines

    def hardening_lines(self, findings: dict) -> list[str]:
        """Per implementation, each (format, bad kind) and what the loader did with it."""
        if not findings:
            return []
        lines = [f"{HARDENING} (bad input; findings, not verdicts - only 'refused after "
                 f"writing' fails):"]
        for impl in sorted(findings):
            lines.append(f"  {impl}:")
            by_key = findings[impl]
            width = max(len(f"{f} {k}") for f, k in by_key)
            for fmt, kind in sorted(by_key):
                texts = sorted(by_key[fmt, kind].items(), key=lambda kv: -len(kv[1]["topologies"]))
                shown = "; ".join(
                    text + (f" [{_topologies(len(e['topologies']))}]" if len(texts) > 1 else "")
                    for text, e in texts)
                detail = texts[0][1]["detail"]
                if detail:
                    if len(detail) > MAX_DETAIL:
                        detail = detail[:MAX_DETAIL - 3] + "..."
                    shown += f": {detail}"
                lines.append(f"    {f'{fmt} {kind}':<{width}}  {shown}")
        return lines

    def footer_lines(self) -> list[str]:
        """Counts of everything that ran, by what it ran against: per implementation (ran /
        skipped, by role-bearing property) and the suites that test no registered
        implementation (the reference and real backends), per property."""
        lines = []
        conformance = self.conformance()
        if conformance:
            by_impl: dict[str, Counter] = {}
            for r in conformance:
                by_impl.setdefault(r.tags["implementation"], Counter())[r.outcome] += 1
            lines.append("weightsync tests per implementation (passed / failed / skipped): "
                         + ", ".join(f"{i} {c['passed']}/{c['failed']}/{c['skipped']}"
                                     + (f" ({c['not run']} without a result)" if c["not run"]
                                        else "")
                                     + (f" ({c[OUTCOME_WAIVED]} waived)" if c[OUTCOME_WAIVED]
                                        else "")
                                     for i, c in sorted(by_impl.items())))
        others = [r for r in self.results.values() if "implementation" not in r.tags]
        if others:
            by_prop: dict[str, Counter] = {}
            for r in others:
                by_prop.setdefault(r.tags.get("property", "-"), Counter())[r.outcome] += 1
            ran = {p: c for p, c in by_prop.items() if c["passed"] or c["failed"]}
            idle = sorted(p for p in by_prop if p not in ran)
            line = ("weightsync tests without an implementation under test (passed / failed / "
                    "skipped): " + ", ".join(f"{p} {c['passed']}/{c['failed']}/{c['skipped']}"
                                             for p, c in ran.items()))
            if idle:
                line += ("; " if ran else "") + "skipped entirely: " + ", ".join(
                    f"{p} ({by_prop[p]['skipped']})" for p in idle)
            lines.append(line)
        return lines

    def backends(self) -> dict:
        out: dict[str, Counter] = {}
        for r in self.results.values():
            if "backend" in r.tags:
                out.setdefault(r.tags["backend"], Counter())[r.outcome] += 1
        return {b: {o: c[o] for o in ("passed", "failed", "skipped")} for b, c in out.items()}

    def _cases_json(self, impl: str, selection: Selection) -> dict:
        """Per property of ``impl``: the cases its claims selected at collection (topology x
        format), the topologies and formats among them, the others by reason (``outside``
        its declared topologies, or ``unclaimed``), and how many of its tests ran to a result
        (passed, failed or waived) in this run."""
        ran: Counter = Counter(r.tags.get("property", "-") for r in self.conformance()
                               if r.tags["implementation"] == impl
                               and r.outcome in ("passed", "failed", OUTCOME_WAIVED))
        out = {}
        for prop, entry in sorted(selection.claims.get(impl, {}).items()):
            out[prop] = {**entry, "tests_ran": ran.get(prop, 0)}
        return out

    def _selection_json(self) -> dict:
        invocation = self.config.invocation_params
        option = self.config.option
        selection = self.selection()
        return {
            "args": list(invocation.args),
            "invocation_dir": str(invocation.dir),
            "rootdir": str(self.config.rootpath),
            "keyword": getattr(option, "keyword", "") or None,
            "markexpr": getattr(option, "markexpr", "") or None,
            "last_failed": bool(getattr(option, "lf", False) or getattr(option, "failedfirst", False)),
            "maxfail": getattr(option, "maxfail", 0) or None,
            "collect_only": self.collect_only(),
            "weightsync_only": list(self.config.getoption("weightsync_only", None) or ()),
            "selected": selection.selected_total,
            "deselected": selection.deselected_total,
            "deselected_per_implementation": dict(selection.deselected),
            "conformance_modules_collected": sorted(selection.modules),
            "known": self.selection_known(),
        }

    def to_json(self) -> dict:
        cells, impls, props, topos = self._axes()
        try:
            known = {e.name: e for e in declared_registry(self.config)}
        except pytest.UsageError:
            known = {}
        optional = optional_names()
        findings = self.findings()
        buckets = self.bucket_limits()
        judged = self.verdicts()
        selection = self.selection()
        implementations = []
        for name in impls:
            entry = known.get(name)
            if entry is not None:
                source, roles = entry.source, list(entry.roles)
            elif name in optional:
                source, roles = f"built-in default (stock {optional[name]})", ["loader"]
            else:
                source = "conftest fixture or worker-only registration"
                roles = selection.roles.get(name)
            v = judged.get(name)
            implementations.append({
                "name": name,
                "source": source,
                "roles": roles,
                "engine": self.engines.get(name) or (
                    _engine(entry.obj) if entry is not None else None),
                "verdict": str(v) if v is not None else "NOT RUN (no test)",
                "verdict_word": v.word if v is not None else "NOT RUN",
                "ran": v.ran if v is not None else 0,
                "total": v.total if v is not None else 0,
                "details": list(v.details) if v is not None else [],
                "claims_not_run": dict(v.unrun) if v is not None else {},
                "cases": self._cases_json(name, selection),
                "outcome": _worst(_worst(t.outcome for t in tests)
                                  for (i, p, _), tests in cells.items()
                                  if i == name and p not in REPORT_PROPERTIES),
                "not_run": [p for p in props if p not in REPORT_PROPERTIES
                            and (name, p) in {(i, q) for (i, q, _) in cells}
                            and not _topology_outcomes(cells, name, p)["passed"]],
                "hardening": self._hardening_cell(findings.get(name, {})),
                BUCKET_LIMIT: self._bucket_cell(buckets.get(name)),
            })
        cell_list, failures = [], []
        for (impl, prop, topo), tests in cells.items():
            failed = [t for t in tests if t.outcome == "failed"]
            cell = {
                "implementation": impl, "property": prop, "topology": topo,
                "outcome": _worst(t.outcome for t in tests),
                "tests": dict(Counter(t.outcome for t in tests)),
                "duration_s": round(sum(t.duration for t in tests), 6),
                "failures": [{"nodeid": t.nodeid, "format": t.tags.get("format"),
                              "message": t.message} for t in failed],
                "skip_reasons": sorted({t.message for t in tests if t.outcome == "skipped"}),
            }
            if failed:
                first = first_failure(failed)
                cell["rerun"] = self.rerun_command(first)
                failures.append({"implementation": impl, "property": prop, "topology": topo,
                                 "nodeid": first.nodeid, "message": first.message,
                                 "located": first.located, "rerun": cell["rerun"]})
            cell_list.append(cell)
        summary = {}
        for impl in impls:
            summary[impl] = {}
            for prop in props:
                c = _topology_outcomes(cells, impl, prop)
                if c:
                    summary[impl][prop] = {o: c[o] for o in ("passed", "failed", "skipped",
                                                             "not run", OUTCOME_WAIVED)
                                           if o in ("passed", "failed", "skipped") or c[o]}
        return {
            "format_version": FORMAT_VERSION,
            "started": _utc(self.started),
            "finished": _utc(self.finished or time.time()),
            "duration_s": round((self.finished or time.time()) - self.started, 3),
            "versions": _versions(),
            "selection": self._selection_json(),
            "interrupted": self.interrupted,
            "exitstatus": self.exitstatus,
            "usage_error": self.config.stash.get(USAGE_ERROR, None),
            "collection_errors": self.collection_errors,
            "implementations": implementations,
            "properties": props,
            "topologies": topos,
            "topology_details": {t: selection.topologies[t] for t in topos
                                 if t in selection.topologies},
            "legend": topology.LEGEND,
            "summary": summary,
            "cells": cell_list,
            "failures": failures,
            "backends": self.backends(),
            "speed": self.speed(),
            "speed_plot": str(self.speed_plot) if self.speed_plot is not None else None,
            "hardening": {impl: [{"format": fmt, "kind": kind, "findings": [
                {"finding": text, **entry} for text, entry in texts.items()]}
                for (fmt, kind), texts in sorted(by_key.items())]
                for impl, by_key in sorted(findings.items())},
            BUCKET_LIMIT: {impl: [{k: e[k] for k in ("topology", "nodeid", "finding", "detail")}
                                  for e in entries] for impl, entries in sorted(buckets.items())},
            "left_behind": self.left_behind(),
            "waivers": (waivers.of(self.config).to_json() if waivers.of(self.config) is not None
                        else None),
            "tests": [{"nodeid": r.nodeid, **r.tags, "outcome": r.outcome,
                       "skip_kind": r.skip_kind, "duration_s": round(r.duration, 6),
                       "message": r.message or None, **r.finding}
                      for r in self.results.values()],
        }


_REPORT = pytest.StashKey[ConformanceReport]()


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        # xdist worker: its reports reach the controller, which builds the matrix; it only
        # records what it selected
        config.pluginmanager.register(SelectionRecorder(config), "weightsync-selection")
        return
    report = ConformanceReport(config)
    config.stash[_REPORT] = report
    config.pluginmanager.register(report, "weightsync-conformance-report")
    config.pluginmanager.register(report.recorder, "weightsync-selection")
    config.pluginmanager.register(report.workers, "weightsync-worker-selections")


def pytest_unconfigure(config: pytest.Config) -> None:
    report = config.stash.get(_REPORT, None)
    if report is not None:
        for plugin in (report, report.recorder, report.workers):
            if config.pluginmanager.is_registered(plugin):
                config.pluginmanager.unregister(plugin)
        del config.stash[_REPORT]
