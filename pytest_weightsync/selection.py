"""What a run selected of the conformance suites, so a verdict can say what it did not run.

A PASS must not be had by not running the suites: ``-k``, ``-m``, ``--lf``, a path narrower
than the suites, ``-x`` stopping early or Ctrl-C all leave claimed cases without a result.
This module records, where collection happens (the pytest process, or every xdist worker),
for each implementation under test:

* the node ids of its selected conformance tests (those it must have a result for);
* how many of its tests were deselected;
* its roles (from the registered objects the tests are parametrized with);
* which shipped conformance modules (``vocabulary.CONFORMANCE_MODULES``) were collected at
  all - ``--lf`` skips whole files, a path argument may name one file;
* per implementation and property, the cases its claims select and why the others are not
  (``claimed.summarize``: the JSON report's case counts).

Under xdist the controller collects nothing: the record travels from each worker with the
first test report it sends (an attribute of the report, which pytest serializes with it), so
the controller knows the whole selection as soon as a worker has started - a run interrupted
mid-way (Ctrl-C reaches the workers too, and they never finish their session) still counts
what ran against everything selected, not against what happened to report. It travels again
in ``workeroutput`` at the end (as pytest-cov's data does), and the first worker's record is
used: xdist requires every worker to collect the same items. A run whose workers all went
down before reporting anything leaves the selection unknown, which the verdict treats like an
interruption.

No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import pytest

from pytest_weightsync import claimed, topology
from pytest_weightsync.registry import registered_of
from pytest_weightsync.vocabulary import CONFORMANCE_MODULES, REPORT_PROPERTIES

WORKEROUTPUT_KEY = "weightsync_selection"
#: The attribute of a worker's first test report that carries its selection to the controller.
REPORT_ATTRIBUTE = "weightsync_selection"


@dataclass
class Selection:
    """One run's selection of conformance tests (JSON-able through :meth:`to_dict`)."""

    selected: dict = field(default_factory=dict)    # implementation -> [nodeid, ...]
    deselected: dict = field(default_factory=dict)  # implementation -> count
    roles: dict = field(default_factory=dict)       # implementation -> [role, ...]
    modules: set = field(default_factory=set)       # conformance module names collected
    deselected_total: int = 0
    selected_total: int = 0
    topologies: dict = field(default_factory=dict)  # topology id -> topology.describe(case)
    #: implementation -> property -> what its claims select (``claimed.summarize``)
    claims: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"selected": self.selected, "deselected": self.deselected, "roles": self.roles,
                "modules": sorted(self.modules), "deselected_total": self.deselected_total,
                "selected_total": self.selected_total, "topologies": self.topologies,
                "claims": self.claims}

    @classmethod
    def from_dict(cls, data: dict) -> "Selection":
        return cls(selected={k: list(v) for k, v in data.get("selected", {}).items()},
                   deselected=dict(data.get("deselected", {})),
                   roles={k: list(v) for k, v in data.get("roles", {}).items()},
                   modules=set(data.get("modules", ())),
                   deselected_total=int(data.get("deselected_total", 0)),
                   selected_total=int(data.get("selected_total", 0)),
                   topologies=dict(data.get("topologies", {})),
                   claims=dict(data.get("claims", {})))

    def implementations(self) -> list[str]:
        return sorted(set(self.selected) | set(self.deselected))

    def missing_modules(self, impl: str) -> list[str]:
        """Shipped conformance modules for ``impl``'s roles that this run did not collect."""
        roles = set(self.roles.get(impl, ()))
        return [m for m, for_roles in CONFORMANCE_MODULES.items()
                if roles & set(for_roles) and m not in self.modules]


def _property(item: pytest.Item) -> Optional[str]:
    marker = item.get_closest_marker("weightsync_property")
    return None if marker is None or not marker.args else str(marker.args[0])


def conformance_module(item: pytest.Item) -> Optional[str]:
    """The shipped conformance module ``item`` belongs to (``test_loader``, ...), else ``None``."""
    module = getattr(item, "module", None)
    name = getattr(module, "__name__", "") or ""
    package, _, leaf = name.rpartition(".")
    if package.endswith("conformance") and leaf in CONFORMANCE_MODULES:
        return leaf
    return None


class SelectionRecorder:
    """Builds the :class:`Selection` while collection runs (registered where items are
    collected: the pytest process, or each xdist worker)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.selection = Selection()

    def _count(self, item, into: dict, ids: bool) -> None:
        entry = registered_of(item)
        if entry is None:
            return
        self.selection.roles.setdefault(entry.name, list(entry.roles))
        if ids:
            into.setdefault(entry.name, []).append(item.nodeid)
        else:
            into[entry.name] = into.get(entry.name, 0) + 1

    @pytest.hookimpl
    def pytest_itemcollected(self, item: pytest.Item) -> None:
        module = conformance_module(item)
        if module is not None:
            self.selection.modules.add(module)

    @pytest.hookimpl
    def pytest_deselected(self, items) -> None:
        for item in items:
            self.selection.deselected_total += 1
            if _property(item) not in REPORT_PROPERTIES:  # deselecting a report leaves no claim out
                self._count(item, self.selection.deselected, ids=False)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.selection.selected = {}
        self.selection.selected_total = len(session.items)
        for item in session.items:
            self._count(item, self.selection.selected, ids=True)
            case = topology.topology_of(item)
            if case is not None and case.id not in self.selection.topologies:
                self.selection.topologies[case.id] = topology.describe(case)
        self.selection.claims = claimed.summarize(session.items)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        """On an xdist worker, the first report it makes carries the selection (see the
        module docstring)."""
        outcome = yield
        if getattr(self.config, "workerinput", None) is None or getattr(self, "_sent", False):
            return
        self._sent = True
        setattr(outcome.get_result(), REPORT_ATTRIBUTE, self.selection.to_dict())

    @pytest.hookimpl
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        output = getattr(self.config, "workeroutput", None)
        if output is not None:
            output[WORKEROUTPUT_KEY] = self.selection.to_dict()


class WorkerSelections:
    """On the xdist controller: the selection records the workers send, with their first
    report and when they finish."""

    def __init__(self) -> None:
        self.records: dict = {}  # worker id -> Selection, in arrival order
        self.lost: list[str] = []  # workers that went down without a record

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report) -> None:
        data = report.__dict__.pop(REPORT_ATTRIBUTE, None)  # the other plugins never see it
        if data is not None:
            node = getattr(report, "node", None)
            worker = getattr(node, "workerinput", {}).get("workerid", str(node))
            self.records.setdefault(worker, Selection.from_dict(data))

    @pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown without pytest-xdist
    def pytest_testnodedown(self, node, error) -> None:
        data = getattr(node, "workeroutput", {}).get(WORKEROUTPUT_KEY)
        worker = getattr(node, "workerinput", {}).get("workerid", str(node))
        if data is not None:
            self.records[worker] = Selection.from_dict(data)
        elif worker not in self.records:
            self.lost.append(str(getattr(node, "gateway", node)))

    def selection(self) -> Optional[Selection]:
        return next(iter(self.records.values()), None)
