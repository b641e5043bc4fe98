"""The conformance matrix: implementation x property x topology, in the terminal, as JSON
(``--weightsync-report PATH``) and as junit properties.

Tagging happens at collection: every test that checks a property (marker
``weightsync_property(name)``) or runs against a registered implementation gets
``item.user_properties`` entries naming its implementation, property, topology, payload
format and backend (marker ``weightsync_backend(name)``). pytest's ``--junitxml`` writes
``user_properties`` as ``<property>`` elements, and pytest-xdist forwards them with every
report, so the matrix is built on the controller from reports alone
(``pytest_runtest_logreport``), never from items - it works the same under ``-n``.

The verdict of an implementation is decided by its conformance properties only: every
property but :data:`HARDENING` (bit_exact, in_place, ..., and whatever property a suite adds).
It is **FAIL** when any of their tests failed, **NOT RUN (props)** when a property collected for
it ran no case at all (every case skipped: a claim too narrow to test, or a filter), and
**PASS** only when every such property passed at least one case. :data:`HARDENING` is a report:
its tests record a finding per bad kind (``record_property("weightsync_finding", ...)``, which
xdist forwards like the tags) and are listed per implementation, never counted in the verdict
(a hardening test that fails - a loader that refused a bucket after writing part of it - is a
conformance failure and does count).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

from pytest_weightsync.registry import declared_registry, implementation_of, optional_names

PREFIX = "weightsync_"
KEYS = ("implementation", "property", "topology", "format", "backend")
#: Parameters whose value names the payload format / sync path / capability taken away.
FORMAT_PARAMS = ("payload_format", "path", "fmt", "restriction")
#: What a test or a cell counts as, worst first.
OUTCOMES = ("failed", "passed", "skipped")
MAX_MESSAGE = 4000
#: The property whose tests report findings (strictness on bad input) instead of a verdict.
HARDENING = "hardening"
#: user_properties keys the hardening probe records at run time.
FINDING_KEYS = ("bad_kind", "finding", "finding_detail")
MAX_DETAIL = 100


def _marker_arg(item: pytest.Item, name: str) -> Optional[str]:
    marker = item.get_closest_marker(name)
    if marker is None:
        return None
    value = marker.args[0] if marker.args else marker.kwargs.get("name")
    return None if value is None else str(value)


def _topology_of(item: pytest.Item) -> Optional[str]:
    """The id of a topology-matrix case among the test's parameters (anything with ``spec``,
    ``receiver`` and a string ``id``, like ``suites/matrix.Case``)."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return None
    for value in callspec.params.values():
        case_id = getattr(value, "id", None)
        if isinstance(case_id, str) and hasattr(value, "spec") and hasattr(value, "receiver"):
            return case_id
    return None


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
        for key, value in tags_of(item).items():
            if PREFIX + key not in present:
                item.user_properties.append((PREFIX + key, value))


# --------------------------------------------------------------------------------------------
# Collecting outcomes from reports
# --------------------------------------------------------------------------------------------


@dataclass
class TestResult:
    nodeid: str
    tags: dict
    outcome: str = "passed"
    message: str = ""
    phases: set = field(default_factory=set)
    finding: dict = field(default_factory=dict)

    def update(self, report) -> None:
        self.phases.add(report.when)
        if report.failed:
            if self.outcome != "failed":
                self.message = _failure_message(report)
            self.outcome = "failed"
        elif report.skipped and self.outcome != "failed":
            self.outcome = "skipped"
            self.message = _skip_reason(report)


def _failure_message(report) -> str:
    longrepr = report.longrepr
    crash = getattr(longrepr, "reprcrash", None)
    text = getattr(crash, "message", None) or getattr(report, "longreprtext", "") or str(longrepr)
    if report.when != "call":
        text = f"error in {report.when}: {text}"
    return text[:MAX_MESSAGE]


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        reason = str(longrepr[2])
        return reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason
    return str(longrepr or "")


def _topologies(n: int) -> str:
    return f"{n} topology" if n == 1 else f"{n} topologies"


def _worst(outcomes) -> str:
    outcomes = set(outcomes)
    for outcome in OUTCOMES:
        if outcome in outcomes:
            return outcome
    return "skipped"


def _topology_outcomes(cells: dict, impl: str, prop: str) -> Counter:
    """How many topologies of ``impl`` x ``prop`` passed, failed and skipped; a topology
    counts as the worst outcome among its tests."""
    return Counter(_worst(t.outcome for t in tests)
                   for (i, p, _), tests in cells.items() if i == impl and p == prop)


class ConformanceReport:
    """Outcomes of every tagged test, and what they add up to."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.results: dict[str, TestResult] = {}

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
        result.finding.update({k: str(v) for k, v in props if k in FINDING_KEYS})
        result.update(report)

    def pytest_sessionfinish(self, session) -> None:
        path = self.config.getoption("weightsync_report", None)
        if path:  # written even when no tagged test ran: a CI step may read it unconditionally
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps(self.to_json(), indent=2, sort_keys=False) + "\n")

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.results:
            for line in self.matrix_lines():
                terminalreporter.write_line(line)
        path = self.config.getoption("weightsync_report", None)
        if path:
            terminalreporter.write_line(f"weightsync: conformance report written to {path}")

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
        impls = sorted({k[0] for k in cells})
        props = sorted({k[1] for k in cells}, key=self._property_order)
        topos = sorted({k[2] for k in cells})
        return cells, impls, props, topos

    @staticmethod
    def _property_order(name: str):
        known = ("bit_exact", "export_bit_exact", "in_place", "no_stale_values",
                 "fallback_routing", HARDENING)
        if name == HARDENING:
            return (2, 0, name)
        return (0, known.index(name), name) if name in known else (1, 0, name)

    def verdict(self, impl: str, cells: Optional[dict] = None) -> str:
        """``PASS``, ``FAIL`` or ``NOT RUN (properties that ran no case)`` of ``impl``."""
        cells = self.cells() if cells is None else cells
        mine = {k: v for k, v in cells.items() if k[0] == impl}
        if any(t.outcome == "failed" for tests in mine.values() for t in tests):
            return "FAIL"
        props = sorted({p for (_, p, _) in mine if p != HARDENING}, key=self._property_order)
        if not props:
            return "NOT RUN (no conformance property)"
        not_run = [p for p in props if not _topology_outcomes(cells, impl, p)["passed"]]
        if not_run:
            return f"NOT RUN ({', '.join(not_run)})"
        return "PASS"

    def findings(self) -> dict:
        """``{implementation: {(format, kind): {finding: {"topologies": [...], "detail": the
        first message head}}}}`` of the hardening tests that recorded a finding."""
        out: dict = {}
        for r in self.conformance():
            if r.tags.get("property") != HARDENING or "finding" not in r.finding:
                continue
            key = (r.tags.get("format", "-"), r.finding.get("bad_kind", "-"))
            by_text = out.setdefault(r.tags["implementation"], {}).setdefault(key, {})
            entry = by_text.setdefault(r.finding["finding"], {"topologies": [], "detail": ""})
            entry["topologies"].append(r.tags.get("topology", "-"))
            entry["detail"] = entry["detail"] or r.finding.get("finding_detail", "")
        return out

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

    def _cell_text(self, cells, impl, prop, findings) -> str:
        c = _topology_outcomes(cells, impl, prop)
        if not c:
            return "-"
        if prop == HARDENING:
            text = self._hardening_cell(findings.get(impl, {}))
            return f"{text}, {c['failed']} failed" if c["failed"] else text
        if not c["passed"] and not c["failed"]:
            return "not run"
        return f"{c['passed']}/{c['failed']}/{c['skipped']}"

    def matrix_lines(self) -> list[str]:
        cells, impls, props, topos = self._axes()
        lines = []
        if cells:
            findings = self.findings()
            lines.append("=" * 20 + " weightsync conformance matrix " + "=" * 20)
            lines.append(f"cells: topologies passed / failed / skipped (of {len(topos)} "
                         f"topologies; a topology fails when any of its tests fails; 'not run': "
                         f"no case ran). The verdict counts every property but {HARDENING}.")
            cell_text = {(impl, p): self._cell_text(cells, impl, p, findings)
                         for impl in impls for p in props}
            verdict = {impl: self.verdict(impl, cells) for impl in impls}
            first = max([len("implementation")] + [len(i) for i in impls])
            widths = [max(len(p), max(len(cell_text[i, p]) for i in impls)) for p in props]
            header = "  ".join([f"{'implementation':<{first}}"]
                               + [f"{p:>{w}}" for p, w in zip(props, widths)] + ["verdict"])
            lines.append(header)
            for impl in impls:
                row = [f"{impl:<{first}}"] + [f"{cell_text[impl, p]:>{w}}"
                                              for p, w in zip(props, widths)]
                lines.append("  ".join(row + [verdict[impl]]))
            failures = [t for t in self.conformance() if t.outcome == "failed"]
            if failures:
                lines.append(f"failures ({len(failures)} tests; first per implementation and "
                             f"property):")
                shown = set()
                for t in failures:
                    key = (t.tags["implementation"], t.tags.get("property"))
                    if key in shown:
                        continue
                    shown.add(key)
                    head = t.message.strip().splitlines()[0] if t.message.strip() else "(no message)"
                    lines.append(f"  {key[0]} / {key[1]} / {t.tags.get('topology', '-')}: {head}")
            lines += self.hardening_lines(findings)
        lines += self.footer_lines()
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

    def to_json(self) -> dict:
        cells, impls, props, topos = self._axes()
        try:
            known = {e.name: e for e in declared_registry(self.config)}
        except pytest.UsageError:
            known = {}
        optional = optional_names()
        findings = self.findings()
        implementations = []
        for name in impls:
            entry = known.get(name)
            if entry is not None:
                source, roles = entry.source, list(entry.roles)
            elif name in optional:
                source, roles = f"built-in default (stock {optional[name]})", ["loader"]
            else:
                source, roles = "conftest fixture or worker-only registration", None
            verdict = self.verdict(name, cells)
            implementations.append({
                "name": name,
                "source": source,
                "roles": roles,
                "verdict": verdict,
                "outcome": _worst(_worst(t.outcome for t in tests)
                                  for (i, p, _), tests in cells.items()
                                  if i == name and p != HARDENING),
                "not_run": [p for p in props if p != HARDENING
                            and (name, p) in {(i, q) for (i, q, _) in cells}
                            and not _topology_outcomes(cells, name, p)["passed"]],
                "hardening": self._hardening_cell(findings.get(name, {})),
            })
        cell_list = []
        for (impl, prop, topo), tests in cells.items():
            cell_list.append({
                "implementation": impl, "property": prop, "topology": topo,
                "outcome": _worst(t.outcome for t in tests),
                "tests": dict(Counter(t.outcome for t in tests)),
                "failures": [{"nodeid": t.nodeid, "format": t.tags.get("format"),
                              "message": t.message} for t in tests if t.outcome == "failed"],
                "skip_reasons": sorted({t.message for t in tests if t.outcome == "skipped"}),
            })
        summary = {}
        for impl in impls:
            summary[impl] = {}
            for prop in props:
                c = _topology_outcomes(cells, impl, prop)
                if c:
                    summary[impl][prop] = {o: c[o] for o in ("passed", "failed", "skipped")}
        return {
            "format_version": 2,
            "implementations": implementations,
            "properties": props,
            "topologies": topos,
            "summary": summary,
            "cells": cell_list,
            "backends": self.backends(),
            "hardening": {impl: [{"format": fmt, "kind": kind, "findings": [
                {"finding": text, **entry} for text, entry in texts.items()]}
                for (fmt, kind), texts in sorted(by_key.items())]
                for impl, by_key in sorted(findings.items())},
            "tests": [{"nodeid": r.nodeid, **r.tags, "outcome": r.outcome,
                       "message": r.message or None, **r.finding}
                      for r in self.results.values()],
        }


_REPORT = pytest.StashKey[ConformanceReport]()


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return  # xdist worker: its reports reach the controller, which builds the matrix
    report = ConformanceReport(config)
    config.stash[_REPORT] = report
    config.pluginmanager.register(report, "weightsync-conformance-report")


def pytest_unconfigure(config: pytest.Config) -> None:
    report = config.stash.get(_REPORT, None)
    if report is not None:
        config.pluginmanager.unregister(report)
        del config.stash[_REPORT]
