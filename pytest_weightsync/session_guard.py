"""How the session still ends when the code under test will not let it.

In-process implementation code can leave three things that would keep pytest from ending:

- **A call that never returns**, even with its time-out delivered again and again (it catches
  ``BaseException`` in a loop, or is stuck in C code): :mod:`pytest_weightsync.deadline`
  abandons it after a grace. The session cannot go on beside it, so it is finished from the
  watchdog thread: the test is reported failed with the call's stack, the run counts as
  stopped early (the tests that did not run are "selected but not run"), pytest's
  end-of-session hooks run (terminal summary and matrix, ``--weightsync-report``,
  ``--junitxml``), the child processes the session's implementations left are ended, and the
  process exits with ``os._exit`` and pytest's exit status (1; 4 - a usage error - when it
  happened while the registrations were resolved). An xdist worker only exits: its controller
  reports the test as crashed and goes on. Should the finishing itself hang, the process
  exits anyway after :data:`FINISH_LIMIT` seconds.
- **Child processes** started by implementation code (reported after their test by
  :mod:`pytest_weightsync.process_hygiene`): ended, with whatever they started, when the
  session ends (``pytest_sessionfinish``, and again at ``pytest_unconfigure``), so none
  outlives it.
- **Non-daemon threads** started by a weightsync test
  (:func:`pytest_weightsync.activation.is_weightsync_item`) and still running when the session
  ends: Python joins every non-daemon thread before the process exits, so one that never ends
  would hang the process after pytest has finished. They are named on stderr with the test
  that started them; when the interpreter starts shutting down (``threading._shutdown``) they
  get :data:`THREAD_WAIT` more seconds, and if any still runs the process's ``atexit``
  handlers are run (as the interpreter would after joining the threads) and the process exits
  with pytest's exit status - every report already written - instead of waiting for ever.
  Threads of other tests, of fixtures outside weightsync tests or of the session itself are
  never counted: Python waits for them as it would without the plugin.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
import traceback

import pytest

from pytest_weightsync import deadline as _deadline
from pytest_weightsync.activation import is_weightsync_item
from pytest_weightsync import process_hygiene
from pytest_weightsync.ranks import reaper
from pytest_weightsync.registry import resolution_failed

#: Seconds finishing an abandoned session may take before the process exits anyway.
FINISH_LIMIT = 60.0
#: Seconds stray non-daemon threads of weightsync tests get at interpreter shutdown before the
#: process runs its atexit handlers and exits without them.
THREAD_WAIT = 5.0

_SESSION = pytest.StashKey[pytest.Session]()
_CURRENT = pytest.StashKey[tuple]()
#: ``{ident: (thread, nodeid)}`` of the non-daemon threads weightsync tests left running.
_STARTED_BY_TESTS = pytest.StashKey[dict]()
_PREVIOUS_CALLBACK = pytest.StashKey[object]()

_abandon_lock = threading.Lock()
_abandoning = False
_stray: list[threading.Thread] = []
_exit_status = 0
_original_shutdown = None


def _exit_now(status: int) -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not keep the process alive
            pass
    os._exit(int(status))


# -- a call that never returns ---------------------------------------------------------------


def _report_failed(config: pytest.Config, item: pytest.Item, started: float,
                   message: str) -> None:
    report = pytest.TestReport(
        item.nodeid, item.location, {name: 1 for name in item.keywords}, "failed", message,
        "call", duration=time.time() - started, start=started, stop=time.time(),
        user_properties=list(item.user_properties))
    config.hook.pytest_runtest_logreport(report=report)


def abandon(config: pytest.Config, what: str, message: str) -> None:
    """Finish the session from the watchdog thread while ``what`` keeps the main thread (see
    the module docstring), then end the process."""
    global _abandoning
    with _abandon_lock:
        if _abandoning:
            return
        _abandoning = True
    try:
        signal.setitimer(signal.ITIMER_REAL, 0)
    except (AttributeError, ValueError, OSError):
        pass
    fuse = threading.Timer(FINISH_LIMIT, _exit_now, (int(pytest.ExitCode.TESTS_FAILED),))
    fuse.daemon = True
    fuse.start()
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        try:
            capman.suspend_global_capture(in_=True)
        except Exception:  # noqa: BLE001 - capturing may not have started
            pass
    sys.stderr.write(f"\nweightsync: {message.splitlines()[-1]}\n")
    if hasattr(config, "workerinput"):
        _end_children(config)
        _exit_now(int(pytest.ExitCode.TESTS_FAILED))
    session = config.stash.get(_SESSION, None)
    current = config.stash.get(_CURRENT, None)
    if current is not None:
        status = pytest.ExitCode.TESTS_FAILED
        try:
            _report_failed(config, current[0], current[1], message)
        except Exception:  # noqa: BLE001 - the session must still be finished
            traceback.print_exc()
        if session is not None:
            session.shouldstop = f"{what} could not be stopped and was abandoned"
    else:
        status = pytest.ExitCode.USAGE_ERROR
        resolution_failed(config, message)
    if session is not None:
        session.exitstatus = status
        try:
            config.hook.pytest_sessionfinish(session=session, exitstatus=status)
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        status = session.exitstatus
    try:
        config._ensure_unconfigure()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    _exit_now(int(status))


# -- processes and threads at the end ---------------------------------------------------------


def _end_children(config: pytest.Config) -> None:
    left = process_hygiene.left_children(config)
    alive = reaper.alive(left)
    if not alive:
        return
    ended = reaper.end_all([pid for pid, _ in alive], alive)
    owners = sorted({left[identity] for identity in alive})
    sys.stderr.write(f"weightsync: ended {len(ended)} process(es) left running by "
                     f"implementation code: {', '.join(owners)[:500]}\n")


def _shutdown() -> None:
    """``threading._shutdown`` while stray threads run: wait :data:`THREAD_WAIT` seconds for
    them, then exit rather than join them for ever."""
    end = time.monotonic() + THREAD_WAIT
    for thread in _stray:
        thread.join(max(0.0, end - time.monotonic()))
    alive = [thread for thread in _stray if thread.is_alive()]
    if alive:
        names = ", ".join(repr(t.name) for t in alive[:5])
        _write(f"weightsync: {len(alive)} thread(s) still running after {THREAD_WAIT:g} s "
               f"({names}); running the atexit handlers, then exiting with status "
               f"{_exit_status} without waiting for them\n")
        try:
            atexit._run_exitfuncs()
        except BaseException:  # noqa: BLE001 - a failing handler must not keep the process
            traceback.print_exc()
        _exit_now(_exit_status)
    return _original_shutdown()


def _write(text: str) -> None:
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - a closed stream must not keep the process alive
        pass


def _stray_threads(config: pytest.Config) -> None:
    global _original_shutdown, _exit_status
    started = config.stash.get(_STARTED_BY_TESTS, {})
    stray = [(thread, nodeid) for thread, nodeid in started.values()
             if thread.is_alive() and thread is not threading.current_thread()
             and thread not in _stray]
    if not stray and not _stray:
        return
    session = config.stash.get(_SESSION, None)
    _exit_status = int(session.exitstatus) if session is not None else 0
    if not stray:
        return
    _stray.extend(thread for thread, _ in stray)
    names = ", ".join(f"{t.name!r} (from {nodeid})" for t, nodeid in stray[:5]) + \
        (", ..." if len(stray) > 5 else "")
    sys.stderr.write(
        f"weightsync: {len(stray)} non-daemon thread(s) started by weightsync tests still "
        f"running at the end of the session: {names}; the process waits {THREAD_WAIT:g} s more "
        f"for them at exit, then runs its atexit handlers and exits with status "
        f"{_exit_status} without them\n")
    if _original_shutdown is None and hasattr(threading, "_shutdown"):
        _original_shutdown = threading._shutdown
        threading._shutdown = _shutdown


# -- hooks ------------------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_PREVIOUS_CALLBACK] = _deadline.on_abandon(
        lambda what, message: abandon(config, what, message))


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_SESSION] = session


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    config = item.config
    config.stash.setdefault(_SESSION, item.session)  # activated after the session started
    config.stash[_CURRENT] = (item, time.time())
    own = is_weightsync_item(item)
    before = {t.ident for t in threading.enumerate()} if own else None
    yield
    if _CURRENT in config.stash:
        del config.stash[_CURRENT]
    if own:
        started = config.stash.setdefault(_STARTED_BY_TESTS, {})
        for thread in threading.enumerate():
            if thread.ident not in before and not thread.daemon and thread.is_alive() and \
                    not thread.name.startswith(_deadline.THREAD_PREFIX):
                started.setdefault(thread.ident, (thread, item.nodeid))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Here, not only at unconfigure: an xdist worker may be torn down right after it."""
    _end_children(session.config)
    _stray_threads(session.config)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    previous = config.stash.get(_PREVIOUS_CALLBACK, None)
    if _PREVIOUS_CALLBACK in config.stash:
        _deadline.on_abandon(previous)
        del config.stash[_PREVIOUS_CALLBACK]
    _end_children(config)
    _stray_threads(config)
