"""The conformance report as JSON (``--weightsync-report PATH``): verdicts, versions, the
run's selection, cells with durations and rerun commands, findings, waivers, every test.

A mixin of :class:`pytest_weightsync.report_collect.ConformanceReport`: it reads that
report's aggregates and the matrix's cell words (``MatrixLines`` of :mod:`.report_matrix`),
so the JSON format (:data:`FORMAT_VERSION`) changes here and nowhere else.
"""

from __future__ import annotations

import sys
import time
from collections import Counter

import pytest

from pytest_weightsync import topology, waivers
from pytest_weightsync.registry import USAGE_ERROR, declared_registry, optional_names
from pytest_weightsync.report_results import _engine, _topology_outcomes, _worst, first_failure
from pytest_weightsync.selection import Selection
from pytest_weightsync.vocabulary import BUCKET_LIMIT, OUTCOME_WAIVED, REPORT_PROPERTIES

#: Versions of these distributions go into the JSON report (read from metadata, no import).
VERSIONED = ("pytest-weightsync", "pytest", "pytest-xdist", "hypothesis", "torch", "sglang",
             "megatron-core", "megatron-bridge", "transformer-engine")
FORMAT_VERSION = 6


def _versions() -> dict:
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


class JsonReport:
    """The JSON report of a :class:`~pytest_weightsync.report_collect.ConformanceReport`."""

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
