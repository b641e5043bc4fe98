"""An implementation whose calls keep timing out is cut off: the rest of its cases do not run.

Every in-process call is bounded (:mod:`pytest_weightsync.deadline`), but each time-out costs
the whole limit, and a loader that hangs in every call would cost the number of its tests
times the limit (about 33 hours for the shipped suites at the default 300 s). So once
``--weightsync-max-call-timeouts`` calls of one implementation (default
:data:`DEFAULT_MAX_TIMEOUTS`; ``0``: never cut off) have timed out in this pytest process,
each of its remaining tests is skipped at setup with :class:`CutOff`, whose reason names the
implementation and the calls that timed out. Its skip kind is ``not_run``: such a case counts
as not run, never as passed (:mod:`pytest_weightsync.verdict`), and the time-outs themselves
are failures, so the verdict is FAIL.

Under pytest-xdist each worker counts its own time-outs.
"""

from __future__ import annotations

from typing import Optional

import pytest

from pytest_weightsync.registry import registered_of
from pytest_weightsync.vocabulary import SKIP_NOT_RUN

#: Time-outs of one implementation after which its remaining cases are not run.
DEFAULT_MAX_TIMEOUTS = 2


class CutOff(pytest.skip.Exception):
    """Skip: the implementation was cut off after repeated call time-outs."""

    __module__ = "builtins"
    kind = SKIP_NOT_RUN


class Strikes:
    """Timed-out calls per implementation name, and the limit that cuts one off."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.timeouts: dict[str, list[str]] = {}

    def strike(self, name: str, what: str) -> None:
        self.timeouts.setdefault(name, []).append(what)

    def reason(self, name: str) -> Optional[str]:
        """Why ``name`` is cut off, ``None`` while it is not."""
        calls = self.timeouts.get(name, [])
        if not self.limit or len(calls) < self.limit:
            return None
        shown = ", ".join(dict.fromkeys(calls))
        return (f"{name} was cut off after {len(calls)} call time-outs ({shown}; "
                f"--weightsync-max-call-timeouts {self.limit}): its remaining cases were not run")


_ACTIVE: list[Strikes] = []
_STRIKES = pytest.StashKey[Strikes]()


def strike(name: str, what: str) -> None:
    """Count a timed-out call ``what`` of implementation ``name``."""
    if _ACTIVE:
        _ACTIVE[-1].strike(name, what)


def check(name: str) -> None:
    """Raise :class:`CutOff` when implementation ``name`` is cut off."""
    if _ACTIVE:
        reason = _ACTIVE[-1].reason(name)
        if reason is not None:
            raise CutOff(reason, pytrace=False)


def limit_of(config: pytest.Config) -> int:
    value = config.getoption("weightsync_max_call_timeouts", None)
    if value is None:
        value = int(config.getini("weightsync_max_call_timeouts") or DEFAULT_MAX_TIMEOUTS)
    if value < 0:
        raise pytest.UsageError(f"--weightsync-max-call-timeouts must be 0 (never cut off) or "
                                f"positive, got {value}")
    return value


def pytest_configure(config: pytest.Config) -> None:
    strikes = config.stash[_STRIKES] = Strikes(limit_of(config))
    _ACTIVE.append(strikes)


def pytest_unconfigure(config: pytest.Config) -> None:
    strikes = config.stash.get(_STRIKES, None)
    if strikes is not None and strikes in _ACTIVE:
        _ACTIVE.remove(strikes)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    entry = registered_of(item)
    if entry is not None:
        check(entry.name)
