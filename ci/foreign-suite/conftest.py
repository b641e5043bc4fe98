"""A foreign project's test setup, written without pytest-weightsync in mind: its own SIGALRM
handler, an atexit handler, a session fixture holding a child process. ``ci/foreign_check.py``
runs this suite with and without the wheel installed and requires identical runs."""

import atexit
import os
import signal
import subprocess
import sys

import pytest

OUT = os.environ["FOREIGN_OUT"]


def _alarm(signum, frame):  # the project's own handler (e.g. a per-test time limit)
    raise TimeoutError("the project's alarm")


signal.signal(signal.SIGALRM, _alarm)
ALARM_HANDLER = _alarm


def _at_exit():
    with open(os.path.join(OUT, "atexit.txt"), "w") as f:
        f.write("atexit handler ran\n")


atexit.register(_at_exit)


@pytest.fixture(scope="session", autouse=True)
def helper_process():
    """A child process the project starts for its session and ends itself."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    with open(os.path.join(OUT, "child.txt"), "w") as f:
        f.write("alive at teardown\n" if proc.poll() is None else f"gone: {proc.returncode}\n")
    proc.terminate()
    proc.wait(timeout=10)
