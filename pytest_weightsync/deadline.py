"""Time limits for implementation calls made in the pytest process.

A loader whose ``load_weights`` hangs (a deadlock, a sleep, a wait on a peer that never comes)
would otherwise stop the whole conformance run with no word of where. Rank processes are
bounded by ``--weightsync-rank-timeout``; every call the suites make into an implementation in
the pytest process (and the import and instantiation of a registered implementation) is
bounded by ``--weightsync-call-timeout`` (default :data:`DEFAULT_CALL_TIMEOUT` seconds, ``0``
for none): past it the call is interrupted and its test fails with :class:`CallTimeoutError`,
whose message holds the Python stack of the call at that moment.

In the main thread the limit is a ``SIGALRM`` timer (``setitimer``): the handler raises in the
interrupted frame, so blocking sleeps and lock waits are cut short too. Elsewhere (or when
another plugin owns ``SIGALRM``, e.g. pytest-timeout's signal method) a watcher thread raises
the error asynchronously in the calling thread, which takes effect at its next Python bytecode.

Code under test may catch the error (``except Exception``, a retry loop). So the time-out is
delivered again every :data:`REDELIVER_EVERY` seconds until the call ends, as
:class:`TimeoutRedelivered`, which is not an ``Exception`` and passes such handlers; and a
call that caught it and returned (or raised something else) still fails with
:class:`CallTimeoutError`, saying it caught the time-out. A call that catches even
``BaseException`` for ever, or that is stuck inside one C function, cannot be ended in this
process: :func:`abandon_grace` seconds after its time-out a watchdog thread hands it to the
callback installed with :func:`on_abandon` (the plugin reports the test as failed, writes its
reports and ends the process; see :mod:`pytest_weightsync.session_guard`).

No torch here: the plugin loads this module at configure time.
"""

from __future__ import annotations

import ctypes
import signal
import sys
import threading
import time
import traceback
from typing import Callable, Optional

import pytest

#: Seconds an in-process implementation call may take unless configured otherwise.
DEFAULT_CALL_TIMEOUT = 300.0
#: Stack frames shown for a timed-out call (innermost last).
MAX_FRAMES = 30
#: Seconds between deliveries of the time-out to a call that caught it and went on.
REDELIVER_EVERY = 1.0
#: Bounds of the time a call may go on after its time-out before it is abandoned (seconds).
ABANDON_GRACE_MIN, ABANDON_GRACE_MAX = 5.0, 60.0
#: How often the watchdog looks for calls to abandon (seconds).
WATCH_EVERY = 0.25
#: Threads of the harness itself start with this (hygiene checks leave them alone).
THREAD_PREFIX = "weightsync-"

_LIMIT: Optional[float] = DEFAULT_CALL_TIMEOUT
_ON_ABANDON: Optional[Callable[[str, str], None]] = None


class CallTimeoutError(AssertionError):
    """An implementation call did not return within the call time limit."""


class TimeoutRedelivered(BaseException):
    """The time-out, delivered again to a call that caught it and went on. Not an
    ``Exception``, so ``except Exception`` lets it through; :func:`deadline` turns it into
    :class:`CallTimeoutError` on the way out."""


def call_timeout() -> Optional[float]:
    """The configured limit in seconds (``None``: unbounded)."""
    return _LIMIT


def set_call_timeout(seconds: Optional[float]) -> None:
    global _LIMIT
    _LIMIT = None if not seconds or seconds <= 0 else float(seconds)


def abandon_grace(seconds: float) -> float:
    """Seconds a call may go on after its time-out was first delivered before it is
    abandoned: the limit itself, within [:data:`ABANDON_GRACE_MIN`, :data:`ABANDON_GRACE_MAX`]."""
    return min(max(seconds, ABANDON_GRACE_MIN), ABANDON_GRACE_MAX)


def on_abandon(callback: Optional[Callable[[str, str], None]]) -> Optional[Callable]:
    """Install ``callback(what, message)``, called from the watchdog thread for a call that
    went on :func:`abandon_grace` seconds past its time-out; returns the previous one."""
    global _ON_ABANDON
    previous, _ON_ABANDON = _ON_ABANDON, callback
    return previous


def pytest_configure(config: pytest.Config) -> None:
    value = config.getoption("weightsync_call_timeout", None)
    if value is None:
        value = float(config.getini("weightsync_call_timeout") or DEFAULT_CALL_TIMEOUT)
    set_call_timeout(value)
    _WATCHDOG.start()


def _stack_text(frame) -> str:
    lines = traceback.format_stack(frame)[-MAX_FRAMES:]
    return "".join(lines).rstrip()


def _message(what: str, seconds: float, stack: str) -> str:
    return (f"{what} did not return within {seconds:g} s (--weightsync-call-timeout); its "
            f"Python stack when it was stopped:\n{stack}")


def _ours(frame) -> bool:
    """Whether ``frame`` is this module's own code (entering or leaving a deadline), where a
    late time-out must not land."""
    return frame is not None and frame.f_globals.get("__name__") == __name__


class _Call:
    """One bounded call: what it is, its limit, and how its time-out went."""

    def __init__(self, what: str, seconds: float) -> None:
        self.what = what
        self.seconds = seconds
        self.started = time.monotonic()
        self.thread = threading.get_ident()
        self.active = True
        self.deliveries = 0
        self.stack = ""
        self.first: Optional[BaseException] = None
        self.abandoned = False

    def message(self) -> str:
        return _message(self.what, self.seconds, self.stack or "(no frame)")

    def outcome(self, exc: Optional[BaseException]) -> Optional[CallTimeoutError]:
        """The error the call ends with once its time-out was delivered (``None``: it was
        not, and ``exc`` stands)."""
        if not self.deliveries:
            return None
        if self.deliveries == 1 and (exc is self.first or isinstance(exc, _AsyncTimeout)):
            # the plain case: the first delivery ended the call
            return exc if exc is self.first else CallTimeoutError(self.message())
        again = self.deliveries - 1
        if exc is None:
            how = "returned normally"
        elif isinstance(exc, (CallTimeoutError, TimeoutRedelivered)):
            how = "ended"
        else:
            how = f"raised {type(exc).__name__}: {str(exc)[:200]}"
        spent = time.monotonic() - self.started
        return CallTimeoutError(
            f"{self.message()}\n{self.what} caught the time-out and went on; it "
            + (f"was delivered {again} more time(s) (as {TimeoutRedelivered.__name__}, which "
               f"'except Exception' does not catch) and the call " if again else "")
            + f"{how} after {spent:.1f} s")


class _Watchdog:
    """One daemon thread that abandons calls still running :func:`abandon_grace` seconds
    after their time-out (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[int, _Call] = {}
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"{THREAD_PREFIX}call-watchdog")
                self._thread.start()

    def arm(self, call: _Call) -> None:
        with self._lock:
            self._calls[id(call)] = call
        if self._thread is None:
            self.start()

    def disarm(self, call: _Call) -> None:
        with self._lock:
            self._calls.pop(id(call), None)

    def _run(self) -> None:
        while True:
            time.sleep(WATCH_EVERY)
            now = time.monotonic()
            with self._lock:
                due = [c for c in self._calls.values() if c.active and not c.abandoned
                       and now - c.started >= c.seconds + abandon_grace(c.seconds)]
                for call in due:
                    call.abandoned = True
            for call in due:
                self._abandon(call)

    @staticmethod
    def _abandon(call: _Call) -> None:
        callback = _ON_ABANDON
        if callback is None:
            return
        grace = abandon_grace(call.seconds)
        if call.deliveries:
            how = (f"caught the time-out and went on: it was delivered {call.deliveries} "
                   f"time(s) and the call was still running {grace:g} s later (it catches "
                   f"BaseException)")
        else:
            frame = sys._current_frames().get(call.thread)
            call.stack = _stack_text(frame) if frame is not None else ""
            how = (f"could not be interrupted: {grace:g} s after its time-out it had not run "
                   f"Python code to receive it (it is stuck in C code)")
        message = (f"{call.message()}\n{call.what} {how}. A call that cannot be stopped "
                   f"cannot be left running beside the next test: the session ends here")
        try:
            callback(call.what, message)
        except BaseException:  # noqa: BLE001 - the watchdog must outlive a failing callback
            traceback.print_exc()


_WATCHDOG = _Watchdog()


class deadline:  # noqa: N801 - used as a context manager, like contextlib's
    """``with deadline(what, seconds):`` runs the body under a time limit (default: the
    configured call timeout); past it raise :class:`CallTimeoutError` naming ``what`` with the
    body's stack (see the module docstring for a body that catches it)."""

    def __init__(self, what: str, seconds: Optional[float] = None) -> None:
        self.what = what
        self.seconds = call_timeout() if seconds is None else seconds
        self._call: Optional[_Call] = None
        self._previous = None
        self._done: Optional[threading.Event] = None
        self._watcher: Optional[threading.Thread] = None
        self._target: Optional[int] = None

    def __enter__(self) -> "deadline":
        if not self.seconds or self.seconds <= 0:
            return self
        call = self._call = _Call(self.what, float(self.seconds))
        main = threading.current_thread() is threading.main_thread()
        use_signal = (main and hasattr(signal, "setitimer")
                      and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.SIG_IGN,
                                                               None)
                      and signal.getitimer(signal.ITIMER_REAL)[0] == 0)
        _WATCHDOG.arm(call)
        if use_signal:
            self._previous = signal.signal(signal.SIGALRM, self._on_alarm)
            signal.setitimer(signal.ITIMER_REAL, call.seconds, REDELIVER_EVERY)
        else:
            self._start_watcher(call)
        return self

    def __exit__(self, typ, exc, tb) -> bool:
        call = self._call
        if call is None:
            return False
        try:
            call.active = False
            if self._done is None:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, signal.SIG_DFL if self._previous is None
                              else self._previous)
            else:
                self._stop_watcher()
        finally:
            _WATCHDOG.disarm(call)
        error = call.outcome(exc)
        if error is None or error is exc:
            return False
        raise error from (exc if exc is not None and not isinstance(
            exc, (CallTimeoutError, TimeoutRedelivered)) else None)

    # -- SIGALRM, main thread -------------------------------------------------------------

    def _on_alarm(self, signum, frame) -> None:
        call = self._call
        if call is None or not call.active or _ours(frame):
            return  # the body has returned: too late to count
        call.deliveries += 1
        if call.deliveries == 1:
            call.stack = _stack_text(frame)
            call.first = CallTimeoutError(call.message())
            raise call.first
        raise TimeoutRedelivered(call.what)

    # -- a watcher thread, any other thread -----------------------------------------------

    def _start_watcher(self, call: _Call) -> None:
        target = self._target = threading.current_thread().ident
        done = self._done = threading.Event()

        def watch():
            wait = call.seconds
            while not done.wait(wait):
                frame = sys._current_frames().get(target)
                if _ours(frame):
                    wait = REDELIVER_EVERY / 10
                    continue
                call.deliveries += 1
                if call.deliveries == 1:
                    call.stack = _stack_text(frame) if frame is not None else "(no frame)"
                kind = _AsyncTimeout if call.deliveries == 1 else TimeoutRedelivered
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(target),
                                                           ctypes.py_object(kind))
                wait = REDELIVER_EVERY

        self._watcher = threading.Thread(target=watch, daemon=True,
                                         name=f"{THREAD_PREFIX}call-deadline")
        self._watcher.start()

    def _stop_watcher(self) -> None:
        self._done.set()
        while True:
            try:
                self._watcher.join()
                break
            except (_AsyncTimeout, TimeoutRedelivered):  # it landed after the body returned
                continue
        if self._call.deliveries:  # one still pending must not escape later
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._target), None)


class _AsyncTimeout(CallTimeoutError):
    """Raised asynchronously in the calling thread (no message can travel with it)."""
