"""A failure whose message already locates the fault is reported as that message.

A conformance failure is found deep in the harness: the judge compares a receiver rank with the
expected state, and the error it raises says everything a reader needs - the first differing
element in model terms and, when the pattern is a known bug, its name. pytest's default
report adds every harness frame with its arguments (topology cases, parameter dicts, snapshots
of them): pages per failure that say nothing more, and cost as much to format as the test
took to run. For such a failure this sub-plugin replaces the report with the exception's
message, the line of the test it came through, and where it was raised.

Such a failure is an :class:`AssertionError` that

- derives from :class:`LocatedFailure` (every error of :mod:`pytest_weightsync.compare`), or
- has a class named in :data:`LOCATED_NAMES` among its bases: the suites' own
  ``ConformanceError`` (``suites.harness.judge``), matched by name because the harness is
  ``suites.harness`` in the repository and ``pytest_weightsync.suites.harness`` in the wheel,
  and importing it imports torch.

The whole traceback is one option away: ``--tb`` other than the default ``auto``,
``--showlocals`` or ``--full-trace`` leave pytest's own report in place.

No torch here: the plugin registers this module at configure time.
"""

from __future__ import annotations

import os
from typing import Optional

import pytest

#: Class names (anywhere in the MRO) of AssertionErrors reported by their message alone.
LOCATED_NAMES = frozenset({"ConformanceError"})
#: Said under every shortened report, so the frames are never out of reach.
FULL_TRACE_HINT = "--tb=long shows every frame"


class LocatedFailure(AssertionError):
    """Base of assertion errors whose message names what differs and where (a parameter and
    the first differing element); a failing test shows that message, not the frames above it."""


def is_located(error: BaseException) -> bool:
    """Whether ``error`` is reported by its message alone (see the module docstring)."""
    if isinstance(error, LocatedFailure):
        return True
    return isinstance(error, AssertionError) and any(
        cls.__name__ in LOCATED_NAMES for cls in type(error).__mro__)


def _default_style(config: pytest.Config) -> bool:
    return (config.getoption("tbstyle", "auto") == "auto"
            and not config.getoption("showlocals", False)
            and not config.getoption("fulltrace", False))


def _shown_path(path) -> str:
    text = str(path)
    try:
        relative = os.path.relpath(text)
    except ValueError:  # another drive
        return text
    return relative if len(relative) < len(text) else text


def _test_entry(item: pytest.Item, excinfo: pytest.ExceptionInfo):
    """The traceback entry of the test function itself, or ``None`` (a fixture failed)."""
    code = getattr(getattr(item, "obj", None), "__code__", None)
    if code is None:
        return None
    for entry in excinfo.traceback:
        if entry.frame.code.raw is code:
            return entry
    return None


def short_repr(item: pytest.Item, excinfo: pytest.ExceptionInfo):
    """The exception's message, then ``test_file:line: ErrorType`` of the test and the
    function that raised it; ``None`` when pytest cannot locate the error at all."""
    from _pytest._code.code import ReprFileLocation

    rep = excinfo.getrepr(style="value", chain=False)
    crash = rep.reprcrash
    if crash is None or not rep.reprtraceback.reprentries:
        return None
    test = _test_entry(item, excinfo)
    raised = next((e for e in reversed(excinfo.traceback) if not e.ishidden(excinfo)), None)
    if test is not None:
        path, line = _shown_path(test.path), test.lineno + 1
    else:
        path, line = _shown_path(crash.path), crash.lineno
    entry = rep.reprtraceback.reprentries[-1]
    entry.reprfileloc = ReprFileLocation(path, line, excinfo.typename)
    where = ""
    if raised is not None and raised is not test:
        where = f"raised in {raised.name} at {_shown_path(raised.path)}:{raised.lineno + 1}; "
    rep.reprtraceback.extraline = f"({where}{FULL_TRACE_HINT})"
    return rep


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A located failure's report is its message: ``item.repr_failure`` answers it before
    pytest formats the default report - formatting that report (the source of every frame
    parsed again, per failure) would cost as much as the test did, only to be thrown away."""
    original = item.repr_failure

    def repr_failure(excinfo, *args, **kwargs):
        if is_located(excinfo.value) and _default_style(item.config):
            short = short_repr(item, excinfo)
            if short is not None:
                return short
        return original(excinfo, *args, **kwargs)

    item.repr_failure = repr_failure
