"""What one tagged test's reports say: its outcome, message, skip kind and findings.

Every output of the conformance report (the terminal matrix, the JSON report, the verdicts)
reads the same :class:`TestResult` per test, built on the controller from reports alone
(pytest-xdist forwards them), so the rules that turn reports into an outcome - a test counts
only once its call phase reported, a waived failure is ``waived``, a skip keeps its reason -
live here once, beside the keys the tests record and the cut every message goes through.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping, Optional

from pytest_weightsync.vocabulary import BUCKET_LIMIT, OUTCOME_WAIVED, RANKS_COVERED

__all__ = ["TestResult", "cut", "first_failure"]

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


def cut(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters, keeping its head and tail."""
    if len(text) <= limit:
        return text
    head, tail = (limit * 3) // 4, limit // 4
    return f"{text[:head]}\n... [{len(text) - head - tail} characters cut] ...\n{text[-tail:]}"


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
