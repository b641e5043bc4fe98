"""The line between the harness and the code under test, in the pytest process.

Whatever an implementation raises reaches the harness. An ``Exception`` is its test's failure
(or a hardening finding). Anything else would reach further: ``SystemExit`` (``sys.exit``)
ends the session, a ``KeyboardInterrupt`` of its own stops it as if Ctrl-C had been pressed,
pytest's outcomes (``pytest.skip``, ``pytest.xfail``, ``pytest.exit``) decide the test - a
skip from the code under test would pass off a claimed case as not run - and any other
``BaseException`` goes past every ``except Exception`` of the harness. :func:`run` calls the
code under its time limit (:mod:`pytest_weightsync.deadline`) and turns each of these into
:class:`ImplementationAborted`, a failure of its test that names what was raised; the session
goes on. The registry does the same for imports and constructors (a usage error naming the
registration).

A real Ctrl-C during the call is still an interruption of the session. To tell it from a
``KeyboardInterrupt`` the code raised itself, a SIGINT handler installed at configure (when
Python's default one is in place; it then does what the default does) counts the SIGINTs
received; a ``KeyboardInterrupt`` raised while that count moved, or the one
:mod:`pytest_weightsync.ranks.dispatch` raises for SIGTERM, is passed on. Where another
handler owns SIGINT, every ``KeyboardInterrupt`` is passed on.

No torch here: the plugin loads this module at configure time.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Optional

import pytest

from pytest_weightsync.deadline import deadline

#: How many SIGINTs reached the session since the plugin was configured.
_interrupts = 0
_INSTALLED = pytest.StashKey[bool]()


class ImplementationAborted(pytest.fail.Exception):
    """Code under test raised something that is not an ``Exception`` (or one of pytest's
    outcomes); its test fails with this instead of the session ending."""

    __module__ = "builtins"  # shown as "ImplementationAborted: ...", like pytest's own


def _count_sigint(signum, frame) -> None:
    global _interrupts
    _interrupts += 1
    signal.default_int_handler(signum, frame)


def interrupts() -> int:
    """SIGINTs received so far (while :func:`counting`)."""
    return _interrupts


def counting() -> bool:
    """Whether SIGINTs are being counted (the handler of this module owns SIGINT)."""
    try:
        return signal.getsignal(signal.SIGINT) is _count_sigint
    except (ValueError, AttributeError):  # pragma: no cover - no signals here
        return False


def _from_a_signal(exc: BaseException, seen: int) -> bool:
    """Whether ``exc`` (a KeyboardInterrupt) came from a signal sent to the session rather
    than from the code under test."""
    terminated = getattr(sys.modules.get("pytest_weightsync.ranks.dispatch"), "Terminated",
                         None)
    if terminated is not None and isinstance(exc, terminated):
        return True  # SIGTERM, turned into an interrupt by the rank dispatcher
    if _sigint_ignored():
        return False  # no Ctrl-C reaches this process (a background job): the code raised it
    return not counting() or interrupts() != seen


def _sigint_ignored() -> bool:
    try:
        return signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    except (ValueError, AttributeError):  # pragma: no cover - no signals here
        return False


def describe(what: str, exc: BaseException, seen: int) -> Optional[str]:
    """What ``exc``, raised by ``what``, would have done to the session, in words; ``None``
    when it is the code's ordinary error (an ``Exception``, a test failure) or a real
    interruption of the session, to be passed on as it is."""
    name = type(exc).__qualname__
    if isinstance(exc, pytest.exit.Exception):
        return (f"{what} called pytest.exit({exc.msg!r}): code under test may not end the "
                f"pytest session")
    if isinstance(exc, (pytest.skip.Exception, pytest.xfail.Exception)):
        return (f"{what} raised pytest's {name} ({str(exc)[:200]!r}): only the harness "
                f"decides a case's outcome (a skip from the code under test would pass off a "
                f"claimed case as not run)")
    if isinstance(exc, (Exception, pytest.fail.Exception)):
        return None
    if isinstance(exc, KeyboardInterrupt):
        if _from_a_signal(exc, seen):
            return None
        return (f"{what} raised {name} itself (no Ctrl-C reached the session while it ran): "
                f"code under test may not stop the pytest session")
    if isinstance(exc, SystemExit):
        return (f"{what} raised SystemExit({exc.code!r}) (sys.exit): code under test may not "
                f"end the pytest session")
    return (f"{what} raised {name}({str(exc)[:200]!r}), a BaseException that is not an "
            f"Exception: code under test may not raise past the harness's error handling")


def run(what: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` under the call time limit; whatever it raises that would reach
    past its test becomes :class:`ImplementationAborted` (see the module docstring)."""
    seen = _interrupts
    try:
        with deadline(what):
            return fn(*args, **kwargs)
    except BaseException as exc:
        text = describe(what, exc, seen)
        if text is None:
            raise
        raise ImplementationAborted(f"{text}; this test fails instead") from exc


def pytest_configure(config: pytest.Config) -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return  # someone else's handler (or an outer session's counting one)
        signal.signal(signal.SIGINT, _count_sigint)
    except (ValueError, OSError, AttributeError):  # pragma: no cover - no signals here
        return
    config.stash[_INSTALLED] = True


def pytest_unconfigure(config: pytest.Config) -> None:
    if not config.stash.get(_INSTALLED, False):
        return
    del config.stash[_INSTALLED]
    try:
        if signal.getsignal(signal.SIGINT) is _count_sigint:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    except (ValueError, OSError):  # pragma: no cover - not the main thread
        pass
