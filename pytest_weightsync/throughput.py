"""Throughput as a ratio to a plain copy, and a guard that fails a run when a ratio drops.

Absolute GB/s depend on the machine and on whoever else is using it; the ratio of a path's
throughput to one plain copy of the same bytes, measured in the same run and interleaved with
it, mostly does not. So the baseline stores ratios only, and the guard compares ratios.

Tests record a measurement through the ``throughput`` fixture::

    def test_packed_export_keeps_pace_with_a_plain_copy(throughput):
        m = throughput.measure("packed_tp1", lambda: copy_pairs(pairs), nbytes=payload)

At the end of the session ``--weightsync-save-baseline FILE`` writes the ratios as JSON, and
``--weightsync-baseline FILE`` compares them with a stored file and fails the run (exit status
1, with a table) when one dropped by more than the tolerance (``--weightsync-tolerance``, else
the ``weightsync_tolerance`` ini value, 0.10 by default). Measurements travel from xdist
workers in ``user_properties``, so the guard works with ``-n``.

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
    ratios = data.get("ratios") if isinstance(data, dict) else None
    if not isinstance(ratios, dict) or not all(
        isinstance(v, (int, float)) and v > 0 for v in ratios.values()
    ):
        raise BaselineError(
            f"--weightsync-baseline: {path!r} has no 'ratios' mapping of name -> positive number"
        )
    return data


@dataclass(frozen=True)
class Comparison:
    name: str
    baseline: float | None
    measured: float | None
    tolerance: float

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
            return "not measured"
        return "REGRESSED" if self.measured < self.limit else "ok"


def compare(baseline: dict[str, float], measured: dict[str, float], tolerance: float) -> list[Comparison]:
    names = sorted(set(baseline) | set(measured))
    return [Comparison(n, baseline.get(n), measured.get(n), tolerance) for n in names]


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
        for key, value in self._node.user_properties:
            if key == PROPERTY_KEY and value["name"] == m.name:
                raise ValueError(f"throughput name {m.name!r} recorded twice in {self._node.nodeid}")
        self._node.user_properties.append((PROPERTY_KEY, m.to_json()))


@pytest.fixture
def throughput(request: pytest.FixtureRequest) -> ThroughputRecorder:
    """Record named throughput ratios (path vs. plain copy) for the baseline guard."""
    return ThroughputRecorder(request.node)


class ThroughputGuard:
    """Per-session collector (on the controller): gathers ratios, saves, compares, reports."""

    def __init__(self, config: pytest.Config, tolerance: float, baseline: dict[str, Any] | None):
        self.config = config
        self.tolerance = tolerance
        self.baseline = baseline
        self.measurements: dict[str, dict[str, Any]] = {}
        self.comparisons: list[Comparison] = []
        self.failed = False
        self.saved_to: str | None = None
        self.duplicates: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call" or not report.passed:
            return
        for key, value in report.user_properties:
            if key != PROPERTY_KEY:
                continue
            if value["name"] in self.measurements:
                self.duplicates.append(f"{value['name']} (again in {report.nodeid})")
                continue
            self.measurements[value["name"]] = value

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        measured = {n: m["ratio"] for n, m in self.measurements.items()}
        save = self.config.getoption("weightsync_save_baseline", None)
        if save:
            payload = {
                "format": BASELINE_FORMAT,
                "ratios": dict(sorted(measured.items())),
                "tolerance": self.tolerance,
                "machine": machine_info(),
                "measurements": [self.measurements[n] for n in sorted(self.measurements)],
            }
            os.makedirs(os.path.dirname(os.path.abspath(save)), exist_ok=True)
            with open(save, "w") as f:
                json.dump(payload, f, indent=2, sort_keys=True)
                f.write("\n")
            self.saved_to = save
        if self.baseline is not None:
            self.comparisons = compare(self.baseline["ratios"], measured, self.tolerance)
            self.failed = any(c.status == "REGRESSED" for c in self.comparisons)
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
        if self.duplicates:
            tr.write_line(
                "throughput names recorded by more than one test (names must be unique): "
                + ", ".join(self.duplicates),
                red=True,
            )
        if self.saved_to:
            tr.write_line(f"weightsync throughput baseline written to {self.saved_to}")
        if self.comparisons or self.failed:
            title = (
                "weightsync throughput REGRESSION"
                if self.failed
                else "weightsync throughput vs baseline"
            )
            tr.write_sep("=" if self.failed else "-", title, red=self.failed, bold=self.failed)
            for line in comparison_table(self.comparisons):
                tr.write_line(line)
            missing = [c.name for c in self.comparisons if c.status == "not measured"]
            if missing:
                tr.write_line(
                    f"baseline entries not measured in this run: {', '.join(missing)}", yellow=True
                )
            new = [c.name for c in self.comparisons if c.status == "new"]
            if new:
                tr.write_line(
                    f"measured entries absent from the baseline: {', '.join(new)}", yellow=True
                )
            if self.failed:
                tr.write_line(
                    f"a throughput ratio dropped by more than the tolerance "
                    f"({self.tolerance:.0%}); the run fails",
                    red=True,
                )
