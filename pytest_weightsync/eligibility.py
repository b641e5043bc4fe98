"""Run the inline-logprob suite against third-party eligibility functions.

``--weightsync-eligibility module:attr`` (repeatable) names a function that decides whether a
training config may reuse the training forward's log-probs as old-policy log-probs. Every test
that asks for the ``eligibility_impl`` fixture runs once against the reference
(:func:`reference_impl.inline_logprob.inline_logprob_eligibility`) and once per function given.

Adapter contract for a third-party function ``f(config)``:

- ``config`` is an ``argparse.Namespace`` produced by a replica of the training framework's
  real argument parser: it carries exactly the fields the real one does, no more;
- ``f`` returns a ``bool``, or a pair ``(bool, reasons)``, or an object with a bool
  ``.eligible`` attribute (and optionally ``.reasons``). Anything else fails the test with a
  ``TypeError`` naming the function.

On disagreement the test fails with a table of the configs where the function differs from
the expected decision, and the names of any fields the function read that the config does not
carry - the usual cause, since ``getattr(args, "absent_field", default)`` quietly returns the
default.

This module imports neither torch nor the reference at import time.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence

import pytest

REFERENCE_NAME = "reference"
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


@dataclasses.dataclass(frozen=True)
class Case:
    """A config with its expected decision; ``label`` names it in failure tables."""

    label: str
    config: argparse.Namespace
    expected: bool


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
            pytest.fail(disagreement_report(self.name, wrong, len(cases)), pytrace=False)
        return verdicts


def _uniq(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


def _cell(config: argparse.Namespace, key: str) -> str:
    fields = vars(config)
    return repr(fields[key]) if key in fields else "<absent>"


def disagreement_report(name: str, wrong: Sequence[tuple[Case, Verdict]], total: int) -> str:
    """The failure message: a table of (config fields, expected, got), then absent reads."""
    from reference_impl.inline_logprob import FIELDS

    # The columns are the fields the decision depends on; fields it ignores are left out.
    columns = [f.name for f in FIELDS if any(f.name in vars(c.config) for c, _ in wrong)]
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
    for _, verdict in wrong:
        for field in verdict.absent_reads:
            absent[field] = absent.get(field, 0) + 1
    if absent:
        listed = ", ".join(f"{f!r} (in {n} of them)" for f, n in absent.items())
        lines.append(
            f"it read field(s) that the config does not carry: {listed}; the real argparse "
            "Namespace has no such field, so getattr(args, name, default) always yields the "
            "default"
        )
    return "\n".join(lines)


def load_eligibility_function(spec: str) -> EligibilityImpl:
    """Import ``module:attr`` (``attr`` may be dotted) as an :class:`EligibilityImpl`."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise pytest.UsageError(
            f"--weightsync-eligibility {spec!r}: expected MODULE:ATTR, e.g. mypkg.rl:can_inline"
        )
    try:
        obj: object = importlib.import_module(module_name)
    except Exception as exc:  # not only ImportError: a module may fail while importing
        raise pytest.UsageError(
            f"--weightsync-eligibility {spec!r}: cannot import module {module_name!r}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise pytest.UsageError(
                f"--weightsync-eligibility {spec!r}: {module_name!r} has no attribute {attr!r}"
            ) from None
    if not callable(obj):
        raise pytest.UsageError(
            f"--weightsync-eligibility {spec!r}: {attr!r} is a {type(obj).__name__}, "
            "not a function"
        )
    return EligibilityImpl(spec, obj)


def _reference() -> EligibilityImpl:
    from reference_impl.inline_logprob import inline_logprob_eligibility

    return EligibilityImpl(REFERENCE_NAME, inline_logprob_eligibility)


def pytest_configure(config: pytest.Config) -> None:
    specs = dict.fromkeys(config.getoption("weightsync_eligibility", default=None) or [])
    config.stash[_SPECS_KEY] = {spec: load_eligibility_function(spec) for spec in specs}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "eligibility_impl" not in metafunc.fixturenames:
        return
    names = [REFERENCE_NAME, *metafunc.config.stash.get(_SPECS_KEY, {})]
    metafunc.parametrize("eligibility_impl", names, indirect=True, ids=names)


@pytest.fixture
def eligibility_impl(request: pytest.FixtureRequest) -> EligibilityImpl:
    """The eligibility function under test: the reference, then each
    ``--weightsync-eligibility`` function (the test is parametrized over them)."""
    name = getattr(request, "param", REFERENCE_NAME)
    if name == REFERENCE_NAME:
        return _reference()
    return request.config.stash[_SPECS_KEY][name]
