import os
import signal
import threading
import time
import warnings

import pytest

import conftest


@pytest.mark.gpu
def test_gpu_marked_runs_here():
    """The project's gpu tests decide for themselves (no CUDA needed for this one)."""
    with open(os.path.join(conftest.OUT, "gpu.txt"), "w") as f:
        f.write("ran\n")


@pytest.mark.slow
def test_slow_marked():
    assert sum(range(10)) == 45


def test_signal_handlers_are_the_projects():
    assert signal.getsignal(signal.SIGALRM) is conftest.ALARM_HANDLER
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_background_writer_outlives_the_session():
    """A non-daemon thread that finishes a few seconds after the last test (a log flusher)."""
    def flush():
        time.sleep(3)
        with open(os.path.join(conftest.OUT, "thread.txt"), "w") as f:
            f.write("flushed\n")

    threading.Thread(target=flush, name="log-flusher").start()


def test_the_session_child_is_alive(helper_process):
    assert helper_process.poll() is None


def test_warns():
    warnings.warn(UserWarning("a foreign warning"))


def test_fails():
    assert 1 + 1 == 3, "the project's own failing test"
