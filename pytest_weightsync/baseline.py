"""Baseline files of throughput ratios and exact counts, and how a run compares with one.

``--weightsync-save-baseline FILE`` writes what a run measured (format
:data:`BASELINE_FORMAT`: ratios, counts, the test that measured each entry, the machine);
:func:`compare` holds a run against a stored file entry by entry and :func:`comparison_table`
words the result. The pytest guard that reads and writes these files is
:mod:`pytest_weightsync.throughput`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from pytest_weightsync import opcount

BASELINE_FORMAT = 1


class BaselineError(ValueError):
    """A baseline file that is missing or not in the expected format."""


def load_baseline(path: str) -> dict[str, Any]:
    """Read a baseline written by ``--weightsync-save-baseline``; errors name the file."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise BaselineError(
            f"--weightsync-baseline: file {path!r} does not exist "
            "(create one with --weightsync-save-baseline FILE)"
        ) from None
    except json.JSONDecodeError as exc:
        raise BaselineError(f"--weightsync-baseline: {path!r} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or not ("ratios" in data or "counts" in data):
        raise BaselineError(
            f"--weightsync-baseline: {path!r} has neither 'ratios' (name -> positive number) "
            "nor 'counts' (name -> {field: count})"
        )
    ratios = data.get("ratios", {})
    if not isinstance(ratios, dict) or not all(
        isinstance(v, (int, float)) and v > 0 for v in ratios.values()
    ):
        raise BaselineError(
            f"--weightsync-baseline: {path!r} has no 'ratios' mapping of name -> positive number"
        )
    if "counts" in data and not opcount.valid_counts(data["counts"]):
        raise BaselineError(
            f"--weightsync-baseline: {path!r}: 'counts' must map name -> {{field: non-negative int}}"
        )
    sources = data.get("sources", {})
    if not isinstance(sources, dict) or not all(isinstance(v, str) for v in sources.values()):
        raise BaselineError(f"--weightsync-baseline: {path!r}: 'sources' must map name -> test id")
    return data


def test_key(nodeid: str) -> str:
    """A test id that does not depend on where the suite was collected from: the file's base
    name and the rest (``test_x.py::test_y[p]``), so a baseline saved from a checkout still
    names its tests when the suites run from an installed package."""
    path, sep, rest = nodeid.partition("::")
    return path.replace("\\", "/").rsplit("/", 1)[-1] + sep + rest


@dataclass(frozen=True)
class Comparison:
    name: str
    baseline: float | None
    measured: float | None
    tolerance: float
    #: For an entry not measured: "" when its test was part of the run (a failure), else why
    #: it is excused (deselected / not collected).
    excused: str = ""

    @property
    def limit(self) -> float | None:
        return None if self.baseline is None else self.baseline * (1 - self.tolerance)

    @property
    def change(self) -> float | None:
        if self.baseline is None or self.measured is None:
            return None
        return self.measured / self.baseline - 1

    @property
    def status(self) -> str:
        if self.baseline is None:
            return "new"
        if self.measured is None:
            return f"not run ({self.excused})" if self.excused else "NOT MEASURED"
        return "REGRESSED" if self.measured < self.limit else "ok"

    @property
    def failed(self) -> bool:
        return self.status in ("REGRESSED", "NOT MEASURED")


def compare(
    baseline: dict[str, float],
    measured: dict[str, float],
    tolerance: float,
    excused: Callable[[str], str] = lambda name: "",
) -> list[Comparison]:
    names = sorted(set(baseline) | set(measured))
    return [
        Comparison(n, baseline.get(n), measured.get(n), tolerance,
                   excused(n) if n in baseline and n not in measured else "")
        for n in names
    ]


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def comparison_table(rows: list[Comparison]) -> list[str]:
    header = ("name", "baseline ratio", "measured ratio", "change", "limit", "status")
    cells = [
        (
            r.name,
            _fmt(r.baseline, ".3f"),
            _fmt(r.measured, ".3f"),
            _fmt(r.change, "+.1%"),
            _fmt(r.limit, ".3f"),
            r.status,
        )
        for r in rows
    ]
    return text_table(header, cells)


def text_table(header, cells) -> list[str]:
    """Rows of ``cells`` under ``header``, each column as wide as its widest cell."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *cells)]
    line = lambda row: "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()  # noqa: E731
    return [line(header), line(["-" * w for w in widths]), *(line(c) for c in cells)]
