"""Run the inline-logprob suite against third-party eligibility functions.

``--weightsync-eligibility module:attr`` (repeatable) names a function that decides whether a
training config may reuse the training forward's log-probs as old-policy log-probs. Every test
that asks for the ``eligibility_impl`` fixture runs once against the reference (registered by
its ``"module:attr"`` name, :data:`REFERENCE_TARGET`) and once per function given.

Adapter contract for a third-party function ``f(config)``:

- ``config`` is an ``argparse.Namespace`` produced by a replica of the training framework's
  real argument parser: it carries exactly the fields the real one does, no more;
- ``f`` returns a ``bool``, or a pair ``(bool, reasons)``, or an object with a bool
  ``.eligible`` attribute (and optionally ``.reasons``). Anything else fails the test with a
  ``TypeError`` naming the function.

On disagreement the test fails with a table of the configs where the function differs from
the expected decision, then a hint naming the field that decided each difference. The hint is
the suite's harness's to find (each case carries its :class:`Explainer`; the harness compares
with the reference, this plugin imports no decision of its own), by re-running the function
and the reference with one field changed at a time:

- a field whose change alone moves the reference's decision but not the function's (the
  function ignores it, e.g. a negative ``kl_coef``), or moves the function's decision to the
  expected one while the reference's stays (the function objects to a value it should accept);
- a field the function looked up that the config does not carry, but only when supplying it
  (at its parser default, for a field of the reference's table; at any simple value for one
  the frameworks do not define) moves the function to the expected decision. A field read with
  a default that IS the right value (``getattr(args, "max_staleness", 0)`` on slime) is never
  blamed: it did not decide anything.

A case without an explainer (one built by hand) names every absent field the function read.
This module imports neither torch nor the reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Optional, Protocol

import pytest

REFERENCE_NAME = "reference"
#: The reference's decision, the first row of every eligibility test: imported by name, as the
#: registry imports its built-in defaults.
REFERENCE_TARGET = ("pytest_weightsync.reference_impl.rl.inline_logprob:"
                    "inline_logprob_eligibility")
MAX_TABLE_ROWS = 20

_SPECS_KEY = pytest.StashKey[dict]()


class EligibilityResultError(TypeError):
    """An eligibility function returned something the adapter does not understand."""


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One function's answer on one config, normalized by the adapter."""

    eligible: bool | None  # None when the function raised
    reasons: tuple[str, ...] = ()
    error: str | None = None
    absent_reads: tuple[str, ...] = ()  # fields read that the config does not carry

    def shown(self) -> str:
        return f"raised {self.error}" if self.error is not None else str(self.eligible)


class Explainer(Protocol):
    """What explains a disagreement: the suite's harness supplies one with its cases."""

    #: The fields the decision reads, in the order a failure table shows them.
    fields: Sequence[str]

    def deciding_fields(self, func: Callable[[object], object], case: "Case",
                        verdict: Verdict) -> tuple[list[str], list[str]]:
        """``(fields whose value decided the difference, absent fields whose default did)``
        for one case where ``func`` answered ``verdict``."""


@dataclasses.dataclass(frozen=True)
class Case:
    """A config with its expected decision; ``label`` names it in failure tables,
    ``explainer`` (from the harness) finds the fields that decided a disagreement."""

    label: str
    config: argparse.Namespace
    expected: bool
    explainer: Optional[Explainer] = dataclasses.field(default=None, compare=False, repr=False)


def normalize_result(result: object, name: str) -> tuple[bool, tuple[str, ...]]:
    """Map the three accepted return forms onto ``(eligible, reasons)``."""
    if isinstance(result, bool):
        return result, ()
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], bool):
        return result[0], _reasons(result[1], name)
    eligible = getattr(result, "eligible", None)
    if isinstance(eligible, bool):
        return eligible, _reasons(getattr(result, "reasons", ()), name)
    raise EligibilityResultError(
        f"eligibility function {name!r} returned {type(result).__name__} {result!r}; expected "
        "a bool, a (bool, reasons) pair, or an object with a bool .eligible attribute"
    )


def _reasons(reasons: object, name: str) -> tuple[str, ...]:
    if reasons is None:
        return ()
    if isinstance(reasons, str):
        return (reasons,)
    if isinstance(reasons, Iterable):
        return tuple(str(r) for r in reasons)
    raise EligibilityResultError(
        f"eligibility function {name!r} returned reasons of type {type(reasons).__name__}; "
        "expected an iterable of reasons"
    )


def recording_namespace(fields: Mapping[str, object], sink: list[str]) -> argparse.Namespace:
    """An ``argparse.Namespace`` with ``fields`` that appends to ``sink`` the name of every
    attribute looked up but absent (``getattr(ns, name, default)`` included)."""

    class Namespace(argparse.Namespace):
        def __getattr__(self, name: str) -> object:
            if not (name.startswith("__") and name.endswith("__")):
                sink.append(name)
            raise AttributeError(f"'Namespace' object has no attribute {name!r}")

    return Namespace(**fields)


@dataclasses.dataclass(frozen=True)
class EligibilityImpl:
    """An eligibility function under test, with the adapter and the agreement check."""

    name: str
    func: Callable[[object], object]

    def decide(self, config: argparse.Namespace) -> Verdict:
        absent: list[str] = []
        watched = recording_namespace(vars(config), absent)
        try:
            result = self.func(watched)
        except Exception as exc:  # reported in the table, not hidden
            return Verdict(None, error=f"{type(exc).__name__}: {exc}", absent_reads=_uniq(absent))
        eligible, reasons = normalize_result(result, self.name)
        return Verdict(eligible, reasons, absent_reads=_uniq(absent))

    def assert_agrees(self, cases: Sequence[Case]) -> list[Verdict]:
        """Decide every case; fail with a table of the disagreeing ones."""
        verdicts = [self.decide(case.config) for case in cases]
        wrong = [(c, v) for c, v in zip(cases, verdicts) if v.eligible is not c.expected]
        if wrong:
            pytest.fail(disagreement_report(self.name, wrong, len(cases), impl=self),
                        pytrace=False)
        return verdicts


def _uniq(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


def _cell(config: argparse.Namespace, key: str) -> str:
    fields = vars(config)
    return repr(fields[key]) if key in fields else "<absent>"


def disagreement_report(name: str, wrong: Sequence[tuple[Case, Verdict]], total: int,
                        impl: EligibilityImpl | None = None) -> str:
    """The failure message: a table of (config fields, expected, got), then the fields that
    decided the differences (found by each case's explainer through ``impl`` when both are
    given; otherwise every absent read)."""
    explainer = next((c.explainer for c, _ in wrong if c.explainer is not None), None)
    # The columns are the fields the decision depends on; fields it ignores are left out
    # (without an explainer, every field of the configs).
    names = (explainer.fields if explainer is not None
             else dict.fromkeys(k for c, _ in wrong for k in vars(c.config)))
    columns = [n for n in names if any(n in vars(c.config) for c, _ in wrong)]
    header = ["case", *columns, "expected", "got"]
    rows = [
        [case.label]
        + [_cell(case.config, key) for key in columns]
        + [str(case.expected), verdict.shown()]
        for case, verdict in wrong[:MAX_TABLE_ROWS]
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = [
        f"eligibility function {name!r} disagrees with the reference on {len(wrong)} of "
        f"{total} config(s):",
        "  " + " | ".join(h.ljust(w) for h, w in zip(header, widths)),
        "  " + "-+-".join("-" * w for w in widths),
    ]
    lines += ["  " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    if len(wrong) > MAX_TABLE_ROWS:
        lines.append(f"  ... and {len(wrong) - MAX_TABLE_ROWS} more")
    absent: dict[str, int] = {}
    deciding: dict[str, int] = {}
    for case, verdict in wrong[:MAX_TABLE_ROWS]:
        if impl is None or case.explainer is None:
            fields, absent_fields = [], list(verdict.absent_reads)
        else:
            fields, absent_fields = case.explainer.deciding_fields(impl.func, case, verdict)
        for field in fields:
            deciding[field] = deciding.get(field, 0) + 1
        for field in absent_fields:
            absent[field] = absent.get(field, 0) + 1
    if deciding:
        lines.append(
            f"the difference is decided by field(s): {_counted(deciding)}; changing only that "
            "field moves "
            "the reference's decision but not the function's, or the function's to the "
            "expected one"
        )
    if absent:
        lines.append(
            f"it read field(s) that the config does not carry: {_counted(absent)}; the real argparse "
            "Namespace has no such field, so getattr(args, name, default) always yields the "
            "default"
        )
    return "\n".join(lines)


def _counted(fields: dict) -> str:
    return ", ".join(f"{f!r} (in {n} of them)" for f, n in fields.items())


def load_eligibility_function(spec: str) -> EligibilityImpl:
    """Import ``module:attr`` (``attr`` may be dotted) as an :class:`EligibilityImpl`, the
    same way implementations are imported (:func:`pytest_weightsync.registry.import_target`)."""
    from pytest_weightsync.registry import import_target

    obj = import_target(spec, f"--weightsync-eligibility {spec!r}")
    if not callable(obj):
        raise pytest.UsageError(
            f"--weightsync-eligibility {spec!r}: {spec.partition(':')[2]!r} is a "
            f"{type(obj).__name__}, not a function"
        )
    return EligibilityImpl(spec, obj)


@functools.lru_cache(maxsize=None)
def _reference() -> EligibilityImpl:
    from pytest_weightsync.registry import import_target

    return EligibilityImpl(REFERENCE_NAME, import_target(REFERENCE_TARGET, "built-in default"))


def pytest_configure(config: pytest.Config) -> None:
    specs = dict.fromkeys(config.getoption("weightsync_eligibility", default=None) or [])
    config.stash[_SPECS_KEY] = {spec: load_eligibility_function(spec) for spec in specs}


#: The parameter of an eligibility test whose functions ``--weightsync-only`` all left out: such
#: a test is deselected, not skipped as "got empty parameter set".
OUT_OF_SCOPE = "weightsync-only-left-out"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "eligibility_impl" not in metafunc.fixturenames:
        return
    only = set(metafunc.config.getoption("weightsync_only", None) or ())
    # --weightsync-only scopes the reference's row too; a function named by
    # --weightsync-eligibility was asked for by name and always runs
    names = [name for name in (REFERENCE_NAME, *metafunc.config.stash.get(_SPECS_KEY, {}))
             if not only or name != REFERENCE_NAME or name in only]
    if not names:
        metafunc.parametrize("eligibility_impl", [OUT_OF_SCOPE], indirect=True,
                             ids=[OUT_OF_SCOPE])
        return
    metafunc.parametrize("eligibility_impl", names, indirect=True, ids=names)


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    left_out = [item for item in items if getattr(getattr(item, "callspec", None), "params",
                                                  {}).get("eligibility_impl") == OUT_OF_SCOPE]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item not in left_out]


@pytest.fixture
def eligibility_impl(request: pytest.FixtureRequest) -> EligibilityImpl:
    """The eligibility function under test: the reference, then each
    ``--weightsync-eligibility`` function (the test is parametrized over them)."""
    name = getattr(request, "param", REFERENCE_NAME)
    if name == REFERENCE_NAME:
        return _reference()
    return request.config.stash[_SPECS_KEY][name]
