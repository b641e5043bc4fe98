"""The code under test cannot hang or kill the session.

Each scenario is a real ``pytest -p weightsync`` subprocess over a copy of the shipped suites
(``tests/conftest.py``: ``ShippedSuites``) with implementations of ``misbehaving.py`` that do
one wrong thing each - hang in every call, catch the call time-out, leave a non-daemon
thread, child processes, a changed default dtype or environment, memory in a global, raise
``SystemExit`` / ``KeyboardInterrupt`` / ``pytest.skip`` / another ``BaseException``, exit or
hang at import or in ``__init__``. Every run must end (``subprocess`` timeouts guard it) with a
JSON report that names the implementation and what it did. Runs select the two compat cases
of one one-expert topology (``-k``) with a 1-second call limit, so each takes seconds.

The deadline, the boundary and the verdict rule for cut-off cases are also checked in this
process, without a session.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
from toy_sources import TINY_LOADER

from pytest_weightsync import boundary
from pytest_weightsync.deadline import CallTimeoutError, TimeoutRedelivered, deadline
from pytest_weightsync.verdict import Outcome, decide
from pytest_weightsync.vocabulary import FAIL, PARTIAL, SKIP_NOT_RUN

MISBEHAVING = '''
import os
import subprocess
import sys
import threading
import time

''' + TINY_LOADER + '''
class Hangs(Tiny):
    name = "hangs"

    def load_weights(self, params, payload, **kw):
        time.sleep(600)


class SwallowsTimeout(Tiny):
    name = "swallows-timeout"

    def load_weights(self, params, payload, **kw):
        while True:
            try:
                time.sleep(600)
            except Exception:
                pass


class SwallowsAndReturns(Tiny):
    name = "swallows-and-returns"

    def load_weights(self, params, payload, **kw):
        try:
            time.sleep(600)
        except Exception:
            pass
        super().load_weights(params, payload, **kw)


class SwallowsEverything(Tiny):
    name = "swallows-everything"

    def load_weights(self, params, payload, **kw):
        while True:
            try:
                time.sleep(600)
            except BaseException:
                pass


class ExitsInCall(Tiny):
    name = "exits-in-call"

    def load_weights(self, params, payload, **kw):
        sys.exit(5)


class InterruptsInCall(Tiny):
    name = "interrupts-in-call"

    def load_weights(self, params, payload, **kw):
        raise KeyboardInterrupt


class Custom(BaseException):
    pass


class RaisesBase(Tiny):
    name = "raises-base"

    def load_weights(self, params, payload, **kw):
        raise Custom("mine")


class SkipsItself(Tiny):
    name = "skips-itself"

    def load_weights(self, params, payload, **kw):
        import pytest

        pytest.skip("not today")


class LeavesThread(Tiny):
    name = "leaves-thread"

    def load_weights(self, params, payload, **kw):
        if not any(t.name == "never-ends" for t in threading.enumerate()):
            threading.Thread(target=threading.Event().wait, name="never-ends").start()
        super().load_weights(params, payload, **kw)


class LeavesChildren(Tiny):
    name = "leaves-children"

    started = []

    def begin_update(self, params, **kw):
        if not self.started:
            sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
            self.started.append(subprocess.Popen(sleeper))
        super().begin_update(params, **kw)


class ChangesDtype(Tiny):
    name = "changes-dtype"

    def load_weights(self, params, payload, **kw):
        import torch

        super().load_weights(params, payload, **kw)
        torch.set_default_dtype(torch.float64)


class ChangesEnv(Tiny):
    name = "changes-env"

    def load_weights(self, params, payload, **kw):
        super().load_weights(params, payload, **kw)
        os.environ["MISBEHAVING_LOADER_WAS_HERE"] = "1"


class ChecksGlobals(Tiny):
    """Refuses to load unless the session's default dtype and environment are in place."""

    name = "checks-globals"

    def load_weights(self, params, payload, **kw):
        import torch

        carried = "MISBEHAVING_LOADER_WAS_HERE" in os.environ
        if torch.get_default_dtype() != torch.float32 or carried:
            raise ValueError("a previous test's default dtype or environment was carried over")
        super().load_weights(params, payload, **kw)


HELD = []


class HoldsMemory(Tiny):
    name = "holds-memory"

    def load_weights(self, params, payload, **kw):
        import torch

        super().load_weights(params, payload, **kw)
        if not HELD:
            HELD.append(torch.ones(256 * 2**20, dtype=torch.uint8))


class ExitsInInit(Tiny):
    name = "exits-in-init"

    def __init__(self):
        sys.exit(3)


class InterruptsInInit(Tiny):
    name = "interrupts-in-init"

    def __init__(self):
        raise KeyboardInterrupt
'''

CLASSES = {
    "tiny": "Tiny", "hangs": "Hangs", "swallows-timeout": "SwallowsTimeout",
    "swallows-and-returns": "SwallowsAndReturns", "swallows-everything": "SwallowsEverything",
    "exits-in-call": "ExitsInCall", "interrupts-in-call": "InterruptsInCall",
    "raises-base": "RaisesBase", "skips-itself": "SkipsItself", "leaves-thread": "LeavesThread",
    "leaves-children": "LeavesChildren", "changes-dtype": "ChangesDtype",
    "changes-env": "ChangesEnv", "checks-globals": "ChecksGlobals",
    "holds-memory": "HoldsMemory",
}
#: The compat cases of one one-expert topology (the only format the toys claim): two of the
#: on-every-rank property, then one of in-place.
ONE_TOPOLOGY = "on_every_rank and L1E1H8I2"
THREE_CASES = "L1E1H8I2 and (on_every_rank or in_place)"
#: Seconds any inner session may take before the test calls it hung.
SESSION_LIMIT = 240


@pytest.fixture
def suites(shipped):
    (shipped.path / "misbehaving.py").write_text(MISBEHAVING)
    return shipped


def _run(suites, *names: str, args=(), timeout: float = SESSION_LIMIT):
    """``(process, seconds)`` of one inner session over the loader suite with ``names``."""
    selection = []
    for name in names:
        selection += ["--weightsync-loader", f"misbehaving:{CLASSES[name]}",
                      "--weightsync-only", name]
    started = time.monotonic()
    proc = suites.run("suites/conformance/test_loader.py", "-p", "no:cacheprovider",
                      "-p", "no:randomly", "--weightsync-call-timeout", "1", *selection, *args,
                      timeout=timeout)
    return proc, time.monotonic() - started


def _tests(report: dict, impl: str) -> list:
    return [t for t in report["tests"] if t.get("implementation") == impl]


def test_code_that_hangs_raises_past_its_test_or_swallows_the_timeout_fails_only_its_tests(
        suites):
    names = ("exits-in-call", "interrupts-in-call", "raises-base", "skips-itself",
             "swallows-timeout", "swallows-and-returns", "hangs", "tiny")
    proc, seconds = _run(suites, *names, args=("-k", THREE_CASES))
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, out
    report = suites.report()
    assert report["interrupted"] is None, out
    judged = suites.verdicts()
    expected = {
        "exits-in-call": "exits-in-call.load_weights raised SystemExit(5) (sys.exit): code "
                         "under test may not end the pytest session; this test fails instead",
        "interrupts-in-call": "interrupts-in-call.load_weights raised KeyboardInterrupt itself "
                              "(no Ctrl-C reached the session while it ran)",
        "raises-base": "raises-base.load_weights raised Custom('mine'), a BaseException that "
                       "is not an Exception",
        "skips-itself": "skips-itself.load_weights raised pytest's Skipped ('not today'): only "
                        "the harness decides a case's outcome",
        "swallows-timeout": "swallows-timeout.load_weights caught the time-out and went on; it "
                            "was delivered 1 more time(s)",
        "swallows-and-returns": "swallows-and-returns.load_weights caught the time-out and went "
                                "on; it returned normally",
        "hangs": "hangs.load_weights did not return within 1 s (--weightsync-call-timeout)",
    }
    for name, message in expected.items():
        assert judged[name]["verdict_word"] == FAIL, (name, judged[name])
        failed = [t for t in _tests(report, name) if t["outcome"] == "failed"]
        assert failed and all(message in t["message"] for t in failed), (name, failed)
        assert not [t for t in _tests(report, name) if t["outcome"] == "passed"], name
    # two time-outs cut an implementation off: its third case is not run, and says why
    for name in ("hangs", "swallows-timeout", "swallows-and-returns"):
        tests = _tests(report, name)
        assert len([t for t in tests if t["outcome"] == "failed"]) == 2, (name, out)
        cut = [t for t in tests if t["skip_kind"] == SKIP_NOT_RUN]
        assert cut and all(t["message"].startswith(f"{name} was cut off after 2 call "
                                                   f"time-outs ({name}.load_weights; "
                                                   f"--weightsync-max-call-timeouts 2)")
                           for t in cut), (name, cut)
        assert f"not run: {name} was cut off after 2 call time-outs" in judged[name]["verdict"]
    # the session went on: the correct loader, last, ran and passed
    assert [t["outcome"] for t in _tests(report, "tiny") if t["outcome"] != "skipped"] == \
        ["passed"] * 3, out
    assert seconds < SESSION_LIMIT


def test_what_an_implementation_leaves_behind_is_reported_put_back_or_ended(suites, isolated):
    names = ("leaves-thread", "leaves-children", "changes-dtype", "changes-env",
             "checks-globals", "holds-memory", "tiny")
    proc, seconds = _run(suites, *names, args=("-k", ONE_TOPOLOGY, "--weightsync-allow-partial"))
    out = proc.stdout + proc.stderr
    # every test passed; the stray non-daemon thread did not keep the process from exiting
    assert proc.returncode == pytest.ExitCode.OK, out
    left = suites.report()["left_behind"]
    expected = {
        "leaves-thread": "non-daemon: 'never-ends'",
        "leaves-children": "+1 child process (pid ",
        "changes-dtype": "default dtype torch.float32 -> torch.float64 (default dtype put back",
        "changes-env": "environment variables set MISBEHAVING_LOADER_WAS_HERE (environment "
                       "variables put back",
        "holds-memory": "MiB resident memory",
    }
    for name, words in expected.items():
        assert name in left and words in left[name][0]["what"], (name, left.get(name))
        assert left[name][0]["what"].startswith(f"{name} left this in the pytest process")
    assert set(left) == set(expected), left  # nothing blamed on the well-behaved ones
    assert "ImplementationLeakWarning" in out
    assert "weightsync: ended 1 process(es) left running by implementation code: " \
           "leaves-children" in proc.stderr, proc.stderr
    assert "1 non-daemon thread(s) started by weightsync tests still running at the end of " \
           "the session: 'never-ends' (from " in proc.stderr, proc.stderr
    # it got its bounded wait, then the atexit handlers ran and the process ended without it
    assert "thread(s) still running after 5 s ('never-ends'); running the atexit handlers, " \
           "then exiting" in proc.stderr, proc.stderr
    # the dtype and environment were put back before the next implementation's tests
    assert suites.verdicts()["checks-globals"]["verdict_word"] == PARTIAL  # -k: not a PASS
    assert seconds < SESSION_LIMIT
    # no process outlives the session (the isolated fixture checks it too)


def test_a_call_that_cannot_be_stopped_ends_the_session_with_its_report(suites):
    proc, seconds = _run(suites, "swallows-everything", "tiny",
                         args=("-k", ONE_TOPOLOGY, "--junitxml", "junit.xml"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, out
    report = suites.report()
    assert report["interrupted"] == ("stopped early: swallows-everything.load_weights could not "
                                     "be stopped and was abandoned"), report["interrupted"]
    judged = suites.verdicts()
    assert judged["swallows-everything"]["verdict_word"] == FAIL
    failed = [t for t in _tests(report, "swallows-everything") if t["outcome"] == "failed"]
    assert len(failed) == 1 and "was still running 5 s later (it catches BaseException)" in \
        failed[0]["message"], failed
    assert judged["tiny"]["verdict_word"] == "INTERRUPTED", judged["tiny"]
    assert (suites.path / "junit.xml").read_text().count("<failure") == 1
    assert "could not be stopped and was abandoned" in out
    assert seconds < SESSION_LIMIT


@pytest.mark.parametrize("target, words", [
    ("misbehaving:ExitsInInit", "ExitsInInit() raised SystemExit(3) (sys.exit)"),
    ("misbehaving:InterruptsInInit", "InterruptsInInit() raised KeyboardInterrupt itself"),
    ("exits_at_import:X", "importing 'exits_at_import' raised SystemExit(2) (sys.exit)"),
    ("hangs_at_import:X", "importing 'hangs_at_import' did not return within 1 s"),
], ids=["exit-in-init", "interrupt-in-init", "exit-at-import", "hang-at-import"])
def test_a_registration_that_exits_interrupts_or_hangs_is_a_usage_error_with_a_report(
        pytester, target, words):
    """Resolved before any test is collected, so an in-process session shows it (fast)."""
    pytester.makepyfile(misbehaving=MISBEHAVING, exits_at_import="import sys\nsys.exit(2)\n",
                        hangs_at_import="import time\ntime.sleep(600)\n",
                        test_nothing="def test_nothing():\n    pass\n")
    pytester.syspathinsert()
    started = time.monotonic()
    result = pytester.runpytest_inprocess("-p", "weightsync", "-p", "no:cacheprovider",
                                          "--weightsync-call-timeout", "1",
                                          "--weightsync-loader", target,
                                          "--weightsync-report", "report.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    error = json.loads((pytester.path / "report.json").read_text())["usage_error"]
    assert error.startswith(f"--weightsync-loader {target}: ") and words in error, error
    assert error.count(target) == 1, error  # said once, not wrapped twice
    assert words in result.stderr.str()
    assert time.monotonic() - started < 60


# -- in this process --------------------------------------------------------------------------


def _swallowing(seconds: float, then_return: bool = False):
    """Sleep in short naps (an asynchronous exception lands between them), catching every
    ``Exception``; return at the first one caught when ``then_return``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            time.sleep(0.02)
        except Exception:
            if then_return:
                return "returned"
    return "ran out"


def test_a_timeout_caught_and_returned_from_still_fails_the_call():
    with pytest.raises(CallTimeoutError, match="caught the time-out and went on; it returned "
                                               "normally"):
        with deadline("probe.call", 0.2):
            _swallowing(5, then_return=True)


def test_a_timeout_caught_in_a_loop_is_delivered_again_past_except_exception():
    started = time.monotonic()
    with pytest.raises(CallTimeoutError, match="delivered 1 more time"):
        with deadline("probe.call", 0.2):
            _swallowing(30)
    assert time.monotonic() - started < 5


def test_a_timeout_in_another_thread_is_delivered_again_too():
    errors = []

    def body():
        try:
            with deadline("probe.thread", 0.2):
                _swallowing(30)
        except CallTimeoutError as error:
            errors.append(error)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(20)
    assert not thread.is_alive()
    assert errors and "caught the time-out and went on" in str(errors[0])


def test_a_call_that_returns_in_time_is_left_alone():
    with deadline("probe.quick", 5):
        time.sleep(0.01)
    assert not issubclass(TimeoutRedelivered, Exception)


def test_the_boundary_tells_the_codes_own_keyboard_interrupt_from_a_real_ctrl_c():
    if not boundary.counting():
        pytest.skip("SIGINT is not counted in this process (another handler owns it)")

    def own():
        raise KeyboardInterrupt

    with pytest.raises(boundary.ImplementationAborted, match="raised KeyboardInterrupt itself"):
        boundary.run("probe.own", own)

    def real():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)

    with pytest.raises(KeyboardInterrupt) as caught:
        boundary.run("probe.real", real)
    assert type(caught.value) is KeyboardInterrupt


def test_cases_of_a_cut_off_implementation_count_as_not_run_never_as_passed():
    cut = "mine was cut off after 2 call time-outs"
    outcomes = [Outcome("a", "failed"), Outcome("b", "failed"),
                Outcome("c", "skipped", SKIP_NOT_RUN, cut),
                Outcome("d", "skipped", SKIP_NOT_RUN, cut)]
    verdict = decide(outcomes)
    assert verdict.word == FAIL and verdict.ran == 2
    assert f"2 not run: {cut}" in str(verdict)
    verdict = decide([Outcome("a", "passed"), Outcome("c", "skipped", SKIP_NOT_RUN, cut)])
    assert verdict.word == PARTIAL and "1 not run" in str(verdict)
