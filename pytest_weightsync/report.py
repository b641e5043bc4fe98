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

This module is the plugin: it tags tests at collection, marks where they ran what a report
needs (skip kind, located failure, a cut failure report) and registers one
:class:`~pytest_weightsync.report_collect.ConformanceReport` per session. The rest lives by
job: :mod:`.report_results` (one test's outcome from its reports), :mod:`.report_collect`
(the run's outcomes, selection, verdicts and exit status), :mod:`.report_matrix` (the
terminal matrix), :mod:`.report_json` (the JSON report), :mod:`.speed_column` (the speed
cells and plot).
"""

from __future__ import annotations

import json
from typing import Optional

import pytest

from pytest_weightsync import claimed, topology
from pytest_weightsync.registry import implementation_of, registered_of
from pytest_weightsync.report_collect import ConformanceReport
from pytest_weightsync.report_results import ENGINE, MAX_LONGREPR, PREFIX, _engine, cut
from pytest_weightsync.selection import SelectionRecorder
from pytest_weightsync.vocabulary import FORMAT_PARAMS, SKIP_OUTSIDE, SKIP_UNCLAIMED


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
