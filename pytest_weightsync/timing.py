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
from typing import Any, Callable, Optional

__all__ = [
    "Measurement", "ProcessesCopy", "interleaved_samples", "machine_info", "measure",
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


def plain_copy(nbytes: int, device: str, chunk: Optional[int] = None) -> Callable[[], Any]:
    """A callable doing one contiguous copy of ``nbytes`` bytes on ``device`` (the limit),
    queued, not waited for. ``chunk``: buffers of at most that many bytes, copied back to back
    (a model that fills the device leaves no room for two buffers of its size)."""
    import torch

    size = nbytes if chunk is None else max(1, min(nbytes, chunk))
    src = torch.empty(size, dtype=torch.uint8, device=device)
    src.random_(0, 256)
    dst = torch.empty_like(src)
    reps, tail = divmod(nbytes, size) if size else (1, 0)
    if reps == 1 and not tail:
        return lambda: dst.copy_(src)

    def copy() -> None:
        for _ in range(reps):
            dst.copy_(src)
        if tail:
            dst[:tail].copy_(src[:tail])

    return copy


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


class ProcessesCopy:
    """One plain copy of ``nbytes`` split over ``processes`` processes that copy their shares
    at once on one ``device``: each process its own CUDA context, as engine ranks that share
    one GPU are. :meth:`seconds` times it from a common start on the host clock
    (``time.perf_counter``, one monotonic clock for every process) to the last share's end.

    Why: the GPU runs one context at a time and slices its time between contexts that both
    have work, so two processes doing nothing but copying halves take longer than one plain
    copy of the same bytes (0.90 of it on an H100, docs/performance.md, "Two contexts on one
    GPU"). That is the limit of a sync whose engine ranks share one GPU; its ratio to one plain
    copy stays the headline, its ratio to this copy says how near that limit it comes.

    The processes are spawned once (a few seconds each: torch's import) and wait for
    :meth:`seconds`; :meth:`close` (or the context manager) ends them, also after a failure.
    Each holds two buffers of at most ``chunk`` bytes (its share is copied back to back in
    chunks, as :func:`plain_copy`'s callers do for a model larger than memory allows twice).
    """

    def __init__(self, nbytes: int, device: str, processes: int, chunk: int = 1 << 30,
                 timeout: float = 120.0):
        import multiprocessing

        for name, value in (("nbytes", nbytes), ("processes", processes), ("chunk", chunk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if nbytes < processes:
            raise ValueError(f"nbytes ({nbytes}) must be at least one byte per process")
        self.nbytes, self.device, self.timeout = nbytes, str(device), float(timeout)
        shares = [nbytes // processes + (rank < nbytes % processes) for rank in range(processes)]
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        self._out = ctx.Queue()
        self._go = [ctx.Queue() for _ in shares]
        self._procs = [ctx.Process(target=_copy_share, args=(self.device, share, chunk, go,
                                                             self._out), daemon=True)
                       for share, go in zip(shares, self._go)]
        try:
            for proc in self._procs:
                proc.start()
            self._answers("ready")
        except BaseException:
            self.close()
            raise

    def _answers(self, kind: str) -> list:
        """One ``kind`` answer from every process; a process that died or failed, or no
        answer within the timeout, raises at once."""
        import queue

        got, deadline = [], time.monotonic() + self.timeout
        while len(got) < len(self._procs):
            try:
                what, value = self._out.get(timeout=0.2)
            except queue.Empty:
                dead = [p.exitcode for p in self._procs if p.exitcode is not None]
                if dead:
                    raise RuntimeError(f"ProcessesCopy: a copying process exited (code "
                                       f"{dead[0]}) before its {kind!r}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"ProcessesCopy: no {kind!r} from every copying process "
                                       f"within {self.timeout:g} s") from None
                continue
            if what != kind:
                raise RuntimeError(f"ProcessesCopy: a copying process failed: {value}")
            got.append(value)
        return got

    def seconds(self, lead: float = 0.005) -> float:
        """One split copy: every process starts ``lead`` seconds from now (time to wake up)."""
        if not self._procs:
            raise RuntimeError("ProcessesCopy is closed")
        start = time.perf_counter() + lead
        for go in self._go:
            go.put(start)
        return max(self._answers("done")) - start

    def close(self) -> None:
        procs, self._procs = self._procs, []
        for go, proc in zip(self._go, procs):
            if proc.is_alive():
                go.put(None)
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for q in [self._out, *self._go]:
            q.close()
            q.join_thread()

    def __enter__(self) -> "ProcessesCopy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _copy_share(device: str, nbytes: int, chunk: int, go, out) -> None:
    """A :class:`ProcessesCopy` process: copies ``nbytes`` (in chunks) at each start time."""
    try:
        import torch

        torch.set_num_threads(1)
        dev = torch.device(device)
        cuda = dev.type == "cuda"
        if cuda:
            torch.cuda.set_device(dev)
        queue_copy = plain_copy(nbytes, device, chunk)

        def copy() -> None:
            queue_copy()
            if cuda:
                torch.cuda.synchronize(dev)

        copy()  # first-touch and launch warm-up, untimed
        out.put(("ready", None))
    except BaseException as e:  # reported to the parent, which raises it
        out.put(("error", f"{type(e).__name__}: {e}"))
        return
    while True:
        start = go.get()
        if start is None:
            return
        while time.perf_counter() < start:
            pass
        copy()
        out.put(("done", time.perf_counter()))


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
