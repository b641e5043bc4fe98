"""What a run selected of the conformance suites, so a verdict can say what it did not run.

A PASS must not be had by not running the suites: ``-k``, ``-m``, ``--lf``, a path narrower
than the suites, ``-x`` stopping early or Ctrl-C all leave claimed cases without a result.
This module records, where collection happens (the pytest process, or every xdist worker),
for each implementation under test:

* the node ids of its selected conformance tests (those it must have a result for);
* how many of its tests were deselected;
* its roles (from the registered objects the tests are parametrized with);
* which shipped conformance modules (``vocabulary.CONFORMANCE_MODULES``) were collected at
  all - ``--lf`` skips whole files, a path argument may name one file.

Under xdist the record travels to the controller in ``workeroutput`` (as pytest-cov's data
does) and the first worker's record is used: xdist requires every worker to collect the same
items. A worker that died before sending it leaves the selection unknown, which the verdict
treats like an interruption.

No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import pytest

from pytest_weightsync import topology
from pytest_weightsync.registry import registered_of
from pytest_weightsync.vocabulary import CONFORMANCE_MODULES, REPORT_PROPERTIES

WORKEROUTPUT_KEY = "weightsync_selection"


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

    def to_dict(self) -> dict:
        return {"selected": self.selected, "deselected": self.deselected, "roles": self.roles,
                "modules": sorted(self.modules), "deselected_total": self.deselected_total,
                "selected_total": self.selected_total, "topologies": self.topologies}

    @classmethod
    def from_dict(cls, data: dict) -> "Selection":
        return cls(selected={k: list(v) for k, v in data.get("selected", {}).items()},
                   deselected=dict(data.get("deselected", {})),
                   roles={k: list(v) for k, v in data.get("roles", {}).items()},
                   modules=set(data.get("modules", ())),
                   deselected_total=int(data.get("deselected_total", 0)),
                   selected_total=int(data.get("selected_total", 0)),
                   topologies=dict(data.get("topologies", {})))

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

    @pytest.hookimpl
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        output = getattr(self.config, "workeroutput", None)
        if output is not None:
            output[WORKEROUTPUT_KEY] = self.selection.to_dict()


class WorkerSelections:
    """On the xdist controller: the selection records the workers send back."""

    def __init__(self) -> None:
        self.records: list[Selection] = []
        self.lost: list[str] = []  # workers that went down without a record

    @pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown without pytest-xdist
    def pytest_testnodedown(self, node, error) -> None:
        data = getattr(node, "workeroutput", {}).get(WORKEROUTPUT_KEY)
        if data is None:
            self.lost.append(str(getattr(node, "gateway", node)))
        else:
            self.records.append(Selection.from_dict(data))

    def selection(self) -> Optional[Selection]:
        return self.records[0] if self.records else None
