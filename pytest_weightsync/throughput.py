"""Throughput as a ratio to a plain copy, and a guard that fails a run when a ratio drops.

Absolute GB/s depend on the machine and on whoever else is using it; the ratio of a path's
throughput to one plain copy of the same bytes, measured in the same run and interleaved with
it, mostly does not. So the baseline stores ratios only, and the guard compares ratios.

Ratios still move with the machine's load (30-40% on a shared two-core runner); what a path
does per call does not. So tests can also record exact counts (aten operations dispatched,
bytes written, temporaries allocated: :mod:`pytest_weightsync.opcount`), which the guard holds
fixed.

Tests record through the ``throughput`` fixture::

    def test_packed_export_keeps_pace_with_a_plain_copy(throughput):
        m = throughput.measure("packed_tp1", lambda: copy_pairs(pairs), nbytes=payload)
        c = throughput.count_ops("ops/packed", lambda: copy_pairs(pairs))

At the end of the session ``--weightsync-save-baseline FILE`` writes the ratios and counts as
JSON, with the test that measured each entry, and ``--weightsync-baseline FILE`` compares them
with a stored file and fails the run (exit status 1, with a table) when a ratio dropped by
more than the tolerance (``--weightsync-tolerance``, else the ``weightsync_tolerance`` ini
value, else the file's ``tolerance``, else 0.10), when any count rose, or when a stored entry
was not measured although its test was part of the run (skipped, failed, or no longer
recording it); an entry whose test was deselected or not collected is listed as not run.
Measurements travel from xdist workers in ``user_properties``, so the guard works with ``-n``.

torch is imported only inside the measuring functions.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import pytest

from pytest_weightsync import opcount

#: Key under which a measurement rides in ``report.user_properties``.
PROPERTY_KEY = "weightsync_throughput"
BASELINE_FORMAT = 1


# --------------------------------------------------------------------------- measuring


@dataclass(frozen=True)
class Measurement:
    """One path measured against a plain copy of the same bytes in the same run.

    ``ratio`` is path GB/s over plain-copy GB/s (1.0 = as fast as one plain copy), taken per
    round of the interleaved measurement and then the median.
    """

    name: str
    nbytes: int
    path_seconds: float
    copy_seconds: float
    device: str
    ratio: float

    @property
    def path_gbps(self) -> float:
        return self.nbytes / self.path_seconds / 1e9

    @property
    def copy_gbps(self) -> float:
        return self.nbytes / self.copy_seconds / 1e9

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(path_gbps=self.path_gbps, copy_gbps=self.copy_gbps)
        return d


def _timer(device: str) -> Callable[[Callable[[], Any]], float]:
    """Return a function timing one call of fn in seconds: CUDA events on GPU, else wall."""
    import torch

    if device.startswith("cuda"):

        def once(fn):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3

    else:

        def once(fn):
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

    return once


def plain_copy(nbytes: int, device: str) -> Callable[[], Any]:
    """A callable doing one contiguous copy of ``nbytes`` bytes on ``device`` (the limit)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.random_(0, 256)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def interleaved_samples(
    fns: dict[str, Callable[[], Any]],
    device: str,
    repeats: int = 7,
    warmup: int = 2,
    best_of: int = 1,
) -> dict[str, list[float]]:
    """Seconds per call of each fn, ``repeats`` rounds, each round running every fn in turn.

    Round-robin order means load from other processes hits every fn of a round alike. With
    ``best_of > 1`` a sample is the fastest of that many consecutive calls, which drops a call
    that lost the core to another process mid-copy (common on a busy two-core CI machine).
    Single-threaded on CPU (``torch.set_num_threads(1)`` for the duration): with two threads
    on a shared two-core machine a small copy can take 100x longer.
    """
    import torch

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if best_of < 1:
        raise ValueError(f"best_of must be >= 1, got {best_of}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        once = _timer(device)
        for _ in range(warmup):
            for fn in fns.values():
                once(fn)
        samples: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(repeats):
            for k, fn in fns.items():
                samples[k].append(min(once(fn) for _ in range(best_of)))
    finally:
        torch.set_num_threads(threads)
    return samples


def median_seconds_interleaved(
    fns: dict[str, Callable[[], Any]], device: str, repeats: int = 7, warmup: int = 2
) -> dict[str, float]:
    """Median seconds per call of each fn, measured round-robin (see interleaved_samples)."""
    samples = interleaved_samples(fns, device, repeats, warmup)
    return {k: statistics.median(v) for k, v in samples.items()}


def measure(
    name: str,
    fn: Callable[[], Any],
    nbytes: int,
    device: str = "cpu",
    repeats: int = 7,
    warmup: int = 2,
    best_of: int = 3,
) -> Measurement:
    """Measure ``fn`` (which moves ``nbytes``) and a plain copy of ``nbytes`` in one run.

    The ratio is the median over rounds of (plain-copy time / path time) within the round, so
    a slow stretch of a busy machine cancels out instead of landing on one side; GB/s figures
    are from the median times.
    """
    if nbytes <= 0:
        raise ValueError(f"nbytes must be positive, got {nbytes} for {name!r}")
    s = interleaved_samples(
        {"path": fn, "copy": plain_copy(nbytes, device)}, device, repeats, warmup, best_of
    )
    ratio = statistics.median(c / p for c, p in zip(s["copy"], s["path"]))
    return Measurement(
        name, nbytes, statistics.median(s["path"]), statistics.median(s["copy"]), device, ratio
    )


def machine_info(world_size: int = 1) -> dict[str, Any]:
    """What a stored ratio was measured on (informational; the guard compares ratios only)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "world_size": world_size,
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:  # pragma: no cover - torch is a dependency
        info["torch"] = None
        info["gpu"] = None
    return info


# --------------------------------------------------------------------------- baseline


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
    return _table(header, cells)


def _table(header, cells) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *cells)]
    line = lambda row: "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()  # noqa: E731
    return [line(header), line(["-" * w for w in widths]), *(line(c) for c in cells)]


# --------------------------------------------------------------------------- plugin


DEFAULT_TOLERANCE = 0.10


def _ini_is_set(config: pytest.Config, name: str) -> bool:
    """Whether ``name`` was given in an ini file or with ``-o`` (not just its default)."""
    store = getattr(config, "_inicfg", None)  # pytest >= 9 keeps the parsed values here
    if store is None:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            store = getattr(config, "inicfg", None) or {}
    return name in store


def tolerance(config: pytest.Config, baseline: dict[str, Any] | None = None) -> float:
    """The allowed relative drop, from the first of: ``--weightsync-tolerance``, an explicit
    ``weightsync_tolerance`` ini value, the ``tolerance`` stored in the baseline file, 0.10.

    A baseline can carry its own tolerance because the right one depends on the machine
    class it was measured on (a busy two-core CI runner needs more slack than an idle GPU).
    """
    opt = config.getoption("weightsync_tolerance", None)
    if opt is not None:
        value, source = opt, "--weightsync-tolerance"
    elif _ini_is_set(config, "weightsync_tolerance"):
        raw = config.getini("weightsync_tolerance")
        try:
            value = float(raw)
        except ValueError:
            raise pytest.UsageError(f"ini weightsync_tolerance must be a number, got {raw!r}") from None
        source = "ini weightsync_tolerance"
    elif baseline is not None and "tolerance" in baseline:
        value, source = baseline["tolerance"], "the baseline file's 'tolerance'"
    else:
        value, source = DEFAULT_TOLERANCE, "default"
    if not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise pytest.UsageError(f"{source} must be a fraction in [0, 1), got {value!r}")
    return float(value)


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return  # xdist worker: measurements travel to the controller in user_properties
    path = config.getoption("weightsync_baseline", None)
    baseline = None
    if path:
        try:
            baseline = load_baseline(path)
        except BaselineError as exc:
            raise pytest.UsageError(str(exc)) from None
    guard = ThroughputGuard(config, tolerance(config, baseline), baseline)
    config.pluginmanager.register(guard, "weightsync-throughput-guard")


class ThroughputRecorder:
    """What the ``throughput`` fixture returns: measures and records named ratios."""

    def __init__(self, node: pytest.Item):
        self._node = node

    def measure(
        self,
        name: str,
        fn: Callable[[], Any],
        nbytes: int,
        device: str = "cpu",
        repeats: int = 7,
        warmup: int = 2,
        best_of: int = 3,
    ) -> Measurement:
        """Time ``fn`` and a plain copy of ``nbytes`` interleaved; record ratio under ``name``.

        See :func:`measure`: the ratio is the median over ``repeats`` rounds, each sample the
        fastest of ``best_of`` calls."""
        m = measure(name, fn, nbytes, device=device, repeats=repeats, warmup=warmup, best_of=best_of)
        self.record(m)
        return m

    def record(self, m: Measurement) -> None:
        """Attach ``m`` to the test's report; it counts only if the test passes."""
        self._attach(PROPERTY_KEY, m.name, m.to_json())

    def count_ops(self, name: str, fn: Callable[[], Any]) -> opcount.OpCount:
        """Call ``fn`` once under the op counter and record what it did under ``name``
        (see :mod:`pytest_weightsync.opcount`); returns the counts for the test's own checks."""
        counted = opcount.count_ops(name, fn)
        self._attach(opcount.PROPERTY_KEY, name, counted.to_json())
        return counted

    def record_counts(
        self,
        name: str,
        ops: dict[str, int],
        bytes_written: int = 0,
        allocations: int = 0,
        allocated_bytes: int = 0,
    ) -> opcount.OpCount:
        """Record counts the test obtained itself (a plan's launches per step kind, say)."""
        counted = opcount.OpCount(name, dict(ops), bytes_written, allocations, allocated_bytes)
        self._attach(opcount.PROPERTY_KEY, name, counted.to_json())
        return counted

    def _attach(self, key: str, name: str, value: dict[str, Any]) -> None:
        for k, v in self._node.user_properties:
            if k == key and v["name"] == name:
                raise ValueError(f"throughput name {name!r} recorded twice in {self._node.nodeid}")
        self._node.user_properties.append((key, dict(value, test=test_key(self._node.nodeid))))


@pytest.fixture
def throughput(request: pytest.FixtureRequest) -> ThroughputRecorder:
    """Record named throughput ratios (path vs. plain copy) for the baseline guard."""
    return ThroughputRecorder(request.node)


class ThroughputGuard:
    """Per-session collector (on the controller): gathers ratios and counts, saves, compares,
    reports."""

    def __init__(self, config: pytest.Config, tolerance: float, baseline: dict[str, Any] | None):
        self.config = config
        self.tolerance = tolerance
        self.baseline = baseline
        self.measurements: dict[str, dict[str, Any]] = {}
        self.counts: dict[str, dict[str, Any]] = {}
        self.comparisons: list[Comparison] = []
        self.count_changes: list[opcount.CountChange] = []
        self.counts_missing: list[tuple[str, str]] = []  # (name, "" or why excused)
        self.failed = False
        self.saved_to: str | None = None
        self.duplicates: list[str] = []
        #: Outcome of every test that reported in this run, by :func:`test_key`.
        self.outcomes: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.baseline is not None:  # outcomes only explain unmeasured baseline entries
            self._note_outcome(report)
        if report.when != "call" or not report.passed:
            return
        for key, value in report.user_properties:
            store = {PROPERTY_KEY: self.measurements, opcount.PROPERTY_KEY: self.counts}.get(key)
            if store is None:
                continue
            if value["name"] in store:
                self.duplicates.append(f"{value['name']} (again in {report.nodeid})")
                continue
            store[value["name"]] = value

    def _note_outcome(self, report: pytest.TestReport) -> None:
        """Keep the worst outcome of each test (failed > skipped > passed) by :func:`test_key`."""
        key = test_key(report.nodeid)
        if report.failed:
            self.outcomes[key] = f"failed in {report.when}"
        elif report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            reason = reason.removeprefix("Skipped: ")
            if not self.outcomes.get(key, "").startswith("failed"):
                self.outcomes[key] = f"skipped: {reason}"
        else:
            self.outcomes.setdefault(key, "passed without recording it")

    def excused(self, name: str) -> str:
        """Why a stored entry that was not measured does not fail the run ("" if it does):
        only when the test that measured it did not take part in this run at all."""
        source = (self.baseline or {}).get("sources", {}).get(name)
        if source is None:
            return ""  # the baseline does not say which test measures it
        if source in self.outcomes:
            return ""
        return f"{source} deselected or not collected"

    def unmeasured_reason(self, name: str) -> str:
        source = (self.baseline or {}).get("sources", {}).get(name)
        if source is None:
            return "the baseline names no test that measures it"
        return f"{source} {self.outcomes.get(source, 'did not run')}"

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        measured = {n: m["ratio"] for n, m in self.measurements.items()}
        counted = {n: c["fields"] for n, c in self.counts.items()}
        save = self.config.getoption("weightsync_save_baseline", None)
        if save:
            payload: dict[str, Any] = {
                "format": BASELINE_FORMAT,
                "ratios": dict(sorted(measured.items())),
                "tolerance": self.tolerance,
                "machine": machine_info(),
                "measurements": [self.measurements[n] for n in sorted(self.measurements)],
                "sources": {
                    n: v["test"]
                    for n, v in sorted({**self.measurements, **self.counts}.items())
                    if "test" in v
                },
            }
            if counted:
                payload["counts"] = dict(sorted(counted.items()))
            os.makedirs(os.path.dirname(os.path.abspath(save)), exist_ok=True)
            with open(save, "w") as f:
                json.dump(payload, f, indent=2, sort_keys=True)
                f.write("\n")
            self.saved_to = save
        if self.baseline is not None:
            if "ratios" in self.baseline:
                self.comparisons = compare(self.baseline["ratios"], measured, self.tolerance, self.excused)
            stored = self.baseline.get("counts")
            if stored is not None:
                for name, fields in sorted(stored.items()):
                    if name in counted:
                        self.count_changes += opcount.compare_counts(fields, counted[name], name)
                    else:
                        self.counts_missing.append((name, self.excused(name)))
            self.failed = (
                any(c.failed for c in self.comparisons)
                or any(c.worse for c in self.count_changes)
                or any(not why for _, why in self.counts_missing)
            )
        if self.duplicates:
            self.failed = True
        if self.failed and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        tr = terminalreporter
        if self.measurements:
            tr.write_sep("-", "weightsync throughput (ratio = path GB/s / plain-copy GB/s, same run)")
            cells = [
                (
                    n,
                    m["device"],
                    f"{m['nbytes'] / 2**20:.1f}",
                    f"{m['path_gbps']:.2f}",
                    f"{m['copy_gbps']:.2f}",
                    f"{m['ratio']:.3f}",
                )
                for n, m in sorted(self.measurements.items())
            ]
            for line in _table(("name", "device", "MiB", "path GB/s", "copy GB/s", "ratio"), cells):
                tr.write_line(line)
        if self.counts:
            tr.write_sep("-", "weightsync op counts (per call)")
            cells = []
            for n, c in sorted(self.counts.items()):
                f = c["fields"]
                ops = ", ".join(f"{k[3:]} x{v}" for k, v in f.items() if k.startswith("op:"))
                cells.append((n, ops or "-", f["bytes_written"], f["allocations"], f["allocated_bytes"]))
            for line in _table(("name", "ops", "bytes written", "allocations", "allocated bytes"), cells):
                tr.write_line(line)
        if self.duplicates:
            tr.write_line(
                "throughput names recorded by more than one test (names must be unique): "
                + ", ".join(self.duplicates),
                red=True,
            )
        if self.saved_to:
            tr.write_line(f"weightsync throughput baseline written to {self.saved_to}")
        if self.comparisons or self.count_changes or self.counts_missing or self.failed:
            title = (
                "weightsync throughput REGRESSION"
                if self.failed
                else "weightsync throughput vs baseline"
            )
            tr.write_sep("=" if self.failed else "-", title, red=self.failed, bold=self.failed)
            if self.comparisons:
                for line in comparison_table(self.comparisons):
                    tr.write_line(line)
            missing = [c.name for c in self.comparisons if c.status == "NOT MEASURED"]
            missing += [n for n, why in self.counts_missing if not why]
            for name in missing:
                tr.write_line(f"baseline entry {name} was not measured: {self.unmeasured_reason(name)}", red=True)
            excused = [c for c in self.comparisons if c.status.startswith("not run")]
            if excused or any(why for _, why in self.counts_missing):
                names = [c.name for c in excused] + [n for n, why in self.counts_missing if why]
                tr.write_line(f"baseline entries not run (their tests were deselected): {', '.join(names)}", yellow=True)
            new = [c.name for c in self.comparisons if c.status == "new"]
            if self.baseline is not None and "counts" in self.baseline:
                new += [n for n in self.counts if n not in self.baseline["counts"]]
            if new:
                tr.write_line(
                    f"measured entries absent from the baseline: {', '.join(new)}", yellow=True
                )
            if self.count_changes:
                rows = [
                    (c.name, c.field, c.baseline, c.measured,
                     "MORE" if c.worse else "fewer (update the baseline)")
                    for c in self.count_changes
                ]
                for line in _table(("name", "count", "baseline", "measured", "status"), rows):
                    tr.write_line(line, red=any(c.worse for c in self.count_changes))
            if any(c.status == "REGRESSED" for c in self.comparisons):
                tr.write_line(
                    f"a throughput ratio dropped by more than the tolerance "
                    f"({self.tolerance:.0%}); the run fails",
                    red=True,
                )
            if any(c.worse for c in self.count_changes):
                tr.write_line(
                    "a path now does more per call than the baseline records (counts are exact); "
                    "the run fails",
                    red=True,
                )
