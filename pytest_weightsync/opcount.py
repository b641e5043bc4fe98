"""What a path does, counted: the aten operations it dispatches, the bytes it writes, the
temporaries it allocates.

Why counts next to ratios: on a shared two-core CI machine a throughput ratio moves 30-40%
from run to run, so a ratio guard there catches only ~2x regressions, and only sometimes.
What a path does per layer does not move: a regression to a per-expert loop dispatches one
copy per expert instead of one batched copy, an extra staging copy writes the payload twice
and allocates it once. :func:`count_ops` runs a callable under a
``TorchDispatchMode`` that sees every aten call at the dispatcher (after Python and autograd,
before any kernel) and records

- ``ops``: calls per aten overload (``aten.cat.out``, ``aten.copy_.default``), views and
  other metadata-only calls (which write nothing and return aliases) excluded;
- ``bytes_written``: bytes of every argument the schema marks as written (``out=``, in-place
  ``self``, ``_foreach`` lists) plus bytes of every freshly computed result;
- ``allocations`` / ``allocated_bytes``: results that alias no input (new tensors).

Kernels launched outside aten (Triton) are invisible here; a plan records its own step
counts (``CopyPlan.counts()``) through :meth:`ThroughputRecorder.record_counts` instead.

The guard (:mod:`pytest_weightsync.throughput`) compares these numbers exactly against the
baseline's ``counts``: any field above its stored value fails the run; below it passes with a
note to update the file. torch is imported only inside :func:`count_ops`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

#: Key under which a count rides in ``report.user_properties``.
PROPERTY_KEY = "weightsync_opcount"

#: Factory overloads: they allocate but write nothing.
_FACTORIES = ("aten.empty", "aten.new_empty", "aten.empty_like", "aten.empty_strided")


@dataclass(frozen=True)
class OpCount:
    """What one call of a path did (see the module docstring for each field)."""

    name: str
    ops: dict[str, int] = field(default_factory=dict)
    bytes_written: int = 0
    allocations: int = 0
    allocated_bytes: int = 0

    def fields(self) -> dict[str, int]:
        """Flat ``{field: value}``: ``op:<overload>`` per op, then the three totals."""
        out = {f"op:{name}": n for name, n in sorted(self.ops.items())}
        out.update(
            bytes_written=self.bytes_written,
            allocations=self.allocations,
            allocated_bytes=self.allocated_bytes,
        )
        return out

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "fields": self.fields()}


def _tensors(value) -> list:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def count_ops(name: str, fn: Callable[[], Any]) -> OpCount:
    """Call ``fn()`` once and count what it dispatched (see the module docstring)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    ops: dict[str, int] = {}
    totals = {"bytes_written": 0, "allocations": 0, "allocated_bytes": 0}

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            schema = func._schema
            written = []
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is None or not arg.alias_info.is_write:
                    continue
                value = kwargs[arg.name] if arg.name in kwargs else (args[i] if i < len(args) else None)
                written.extend(_tensors(value))
            results = out if isinstance(out, (list, tuple)) else [out]
            fresh = [
                t
                for ret, value in zip(schema.returns, results)
                if ret.alias_info is None
                for t in _tensors(value)
            ]
            if not written and not fresh:
                return out  # a view or metadata call: moves no data
            key = str(func)
            ops[key] = ops.get(key, 0) + 1
            totals["bytes_written"] += _nbytes(written)
            totals["allocations"] += len(fresh)
            totals["allocated_bytes"] += _nbytes(fresh)
            if not key.startswith(_FACTORIES):
                totals["bytes_written"] += _nbytes(fresh)
            return out

    with torch.no_grad(), Counter():  # as senders write: autograd would add its own ops
        fn()
    return OpCount(name, dict(sorted(ops.items())), **totals)


# --------------------------------------------------------------------------- comparing


@dataclass(frozen=True)
class CountChange:
    """One field of one entry that differs from the baseline."""

    name: str
    field: str
    baseline: int
    measured: int

    @property
    def worse(self) -> bool:
        return self.measured > self.baseline


def compare_counts(baseline: dict[str, int], measured: dict[str, int], name: str) -> list[CountChange]:
    """Fields of ``name`` whose measured value differs from the stored one (missing = 0)."""
    changes = []
    for key in sorted(set(baseline) | set(measured)):
        b, m = int(baseline.get(key, 0)), int(measured.get(key, 0))
        if b != m:
            changes.append(CountChange(name, key, b, m))
    return changes


def valid_counts(counts: Any) -> bool:
    """Whether ``counts`` is ``{name: {field: non-negative int}}``."""
    return isinstance(counts, dict) and all(
        isinstance(fields, dict)
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in fields.values())
        for fields in counts.values()
    )
