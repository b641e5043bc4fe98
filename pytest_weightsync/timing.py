"""Throughput as a ratio to a plain copy of the same bytes, measured in the same run.

Absolute GB/s depend on the machine and on whoever else is using it; the ratio of a path's
throughput to one plain copy of the same bytes, measured in the same run and interleaved with
it, mostly does not. :func:`measure` times a path and the plain copy in alternating rounds
(:func:`interleaved_samples`) and reports the median ratio with its spread
(:class:`Measurement`); :func:`machine_info` says where it ran. The benchmarks and the
``throughput`` fixture (:mod:`pytest_weightsync.throughput`) both measure with it.

torch is imported only inside the measuring functions.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

__all__ = [
    "Measurement", "interleaved_samples", "machine_info", "measure",
    "median_seconds_interleaved", "plain_copy",
]


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
