"""Time limits for implementation calls made in the pytest process.

A loader whose ``load_weights`` hangs (a deadlock, a sleep, a wait on a peer that never comes)
would otherwise stop the whole conformance run with no word of where. Rank processes are
bounded by ``--weightsync-rank-timeout``; every call the suites make into an implementation in
the pytest process is bounded by ``--weightsync-call-timeout`` (default
:data:`DEFAULT_CALL_TIMEOUT` seconds, ``0`` for none): past it the call is interrupted and its
test fails with :class:`CallTimeoutError`, whose message holds the Python stack of the call at
that moment.

In the main thread the limit is a ``SIGALRM`` timer (``setitimer``): the handler raises in the
interrupted frame, so blocking sleeps and lock waits are cut short too. Elsewhere (or when
another plugin owns ``SIGALRM``, e.g. pytest-timeout's signal method) a watchdog thread raises
the error asynchronously in the calling thread, which takes effect at its next Python bytecode.
A call stuck inside one C function that never returns is beyond both; the rank timeout and
pytest-timeout's thread method are the tools there.

No torch here: the plugin loads this module at configure time.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys
import threading
import traceback
from typing import Iterator, Optional

import pytest

#: Seconds an in-process implementation call may take unless configured otherwise.
DEFAULT_CALL_TIMEOUT = 300.0
#: Stack frames shown for a timed-out call (innermost last).
MAX_FRAMES = 30

_LIMIT: Optional[float] = DEFAULT_CALL_TIMEOUT


class CallTimeoutError(AssertionError):
    """An implementation call did not return within the call time limit."""


def call_timeout() -> Optional[float]:
    """The configured limit in seconds (``None``: unbounded)."""
    return _LIMIT


def set_call_timeout(seconds: Optional[float]) -> None:
    global _LIMIT
    _LIMIT = None if not seconds or seconds <= 0 else float(seconds)


def pytest_configure(config: pytest.Config) -> None:
    value = config.getoption("weightsync_call_timeout", None)
    if value is None:
        value = float(config.getini("weightsync_call_timeout") or DEFAULT_CALL_TIMEOUT)
    set_call_timeout(value)


def _stack_text(frame) -> str:
    lines = traceback.format_stack(frame)[-MAX_FRAMES:]
    return "".join(lines).rstrip()


def _message(what: str, seconds: float, stack: str) -> str:
    return (f"{what} did not return within {seconds:g} s (--weightsync-call-timeout); its "
            f"Python stack when it was stopped:\n{stack}")


@contextlib.contextmanager
def deadline(what: str, seconds: Optional[float] = None) -> Iterator[None]:
    """Run the body under a time limit (default: the configured call timeout); past it raise
    :class:`CallTimeoutError` naming ``what`` with the body's stack."""
    seconds = call_timeout() if seconds is None else seconds
    if not seconds or seconds <= 0:
        yield
        return
    main = threading.current_thread() is threading.main_thread()
    use_signal = (main and hasattr(signal, "setitimer")
                  and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.SIG_IGN, None)
                  and signal.getitimer(signal.ITIMER_REAL)[0] == 0)
    if use_signal:
        with _signal_deadline(what, seconds):
            yield
    else:
        with _thread_deadline(what, seconds):
            yield


@contextlib.contextmanager
def _signal_deadline(what: str, seconds: float) -> Iterator[None]:
    def on_alarm(signum, frame):
        raise CallTimeoutError(_message(what, seconds, _stack_text(frame)))

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class _AsyncTimeout(CallTimeoutError):
    """Raised asynchronously in the calling thread (no message can travel with it)."""


@contextlib.contextmanager
def _thread_deadline(what: str, seconds: float) -> Iterator[None]:
    target = threading.current_thread().ident
    done = threading.Event()
    stack: list = []

    def watch():
        if done.wait(seconds):
            return
        frame = sys._current_frames().get(target)
        stack.append(_stack_text(frame) if frame is not None else "(no frame)")
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(target),
                                                   ctypes.py_object(_AsyncTimeout))

    watcher = threading.Thread(target=watch, name="weightsync-call-deadline", daemon=True)
    watcher.start()
    try:
        yield
    except _AsyncTimeout:
        raise CallTimeoutError(_message(what, seconds, stack[0] if stack else "")) from None
    finally:
        done.set()
        try:
            watcher.join()
        except _AsyncTimeout:  # it landed after the body had returned
            pass
        if stack:  # one still pending must not escape later
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(target), None)
