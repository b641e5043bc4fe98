"""The conformance matrix: implementation x property x topology, in the terminal, as JSON
(``--weightsync-report PATH``) and as junit properties.

Tagging happens at collection: every test that checks a property (marker
``weightsync_property(name)``) or runs against a registered implementation gets
``item.user_properties`` entries naming its implementation, property, topology, payload
format and backend (marker ``weightsync_backend(name)``). pytest's ``--junitxml`` writes
``user_properties`` as ``<property>`` elements, and pytest-xdist forwards them with every
report, so the matrix is built on the controller from reports alone
(``pytest_runtest_logreport``), never from items - it works the same under ``-n``.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

from pytest_weightsync.registry import base_registry, implementation_of

PREFIX = "weightsync_"
KEYS = ("implementation", "property", "topology", "format", "backend")
#: Parameters whose value names the payload format / sync path / capability taken away.
FORMAT_PARAMS = ("payload_format", "path", "fmt", "restriction")
#: What a test or a cell counts as, worst first.
OUTCOMES = ("failed", "passed", "skipped")
MAX_MESSAGE = 4000


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
        tags = {k[len(PREFIX):]: v for k, v in getattr(report, "user_properties", ())
                if isinstance(k, str) and k.startswith(PREFIX) and k[len(PREFIX):] in KEYS}
        if not tags:
            return
        result = self.results.get(report.nodeid)
        if result is None:
            result = self.results[report.nodeid] = TestResult(report.nodeid, tags)
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
                 "rejects_bad_input", "fallback_routing")
        return (known.index(name), name) if name in known else (len(known), name)

    def matrix_lines(self) -> list[str]:
        cells, impls, props, topos = self._axes()
        lines = []
        if cells:
            lines.append("=" * 20 + " weightsync conformance matrix " + "=" * 20)
            lines.append(f"cells: topologies passed / failed / skipped (of {len(topos)} "
                         f"topologies); a topology fails when any of its tests fails")
            counts = {(impl, prop): _topology_outcomes(cells, impl, prop)
                      for impl in impls for prop in props}
            cell_text = {k: (f"{c['passed']}/{c['failed']}/{c['skipped']}" if c else "-")
                         for k, c in counts.items()}
            verdict = {impl: ("FAIL" if any(counts[impl, p]["failed"] for p in props) else
                              "PASS" if any(counts[impl, p]["passed"] for p in props) else "SKIP")
                       for impl in impls}
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
        others = [r for r in self.results.values() if "implementation" not in r.tags]
        if others:
            by_prop: dict[str, Counter] = {}
            for r in others:
                by_prop.setdefault(r.tags.get("property", "-"), Counter())[r.outcome] += 1
            lines.append("weightsync reference suites (tests passed / failed / skipped): " + ", ".join(
                f"{p} {c['passed']}/{c['failed']}/{c['skipped']}" for p, c in by_prop.items()))
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
            known = {e.name: e for e in base_registry(self.config)}
        except pytest.UsageError:
            known = {}
        implementations = []
        for name in impls:
            entry = known.get(name)
            implementations.append({
                "name": name,
                "source": entry.source if entry else "conftest fixture or worker-only registration",
                "roles": list(entry.roles) if entry else None,
                "verdict": _worst(_worst(t.outcome for t in tests)
                                  for (i, _, _), tests in cells.items() if i == name),
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
            "format_version": 1,
            "implementations": implementations,
            "properties": props,
            "topologies": topos,
            "summary": summary,
            "cells": cell_list,
            "backends": self.backends(),
            "tests": [{"nodeid": r.nodeid, **r.tags, "outcome": r.outcome,
                       "message": r.message or None} for r in self.results.values()],
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
