"""Stopping ``ci/test-all.sh`` stops its pytest: ``ci/forward-signals.sh`` runs the command
as a child in a process group of its own and passes SIGINT / SIGTERM on to that group once;
a script killed outright takes its child with it. A stand-in child (a Python process with a
grandchild, as pytest has xdist workers) records what reached it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "ci" / "forward-signals.sh"

CHILD = '''
import os, subprocess, sys, time
from pathlib import Path

here = Path(sys.argv[1])
grand = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
(here / "pids").write_text(f"{os.getpid()} {grand.pid}")
try:
    while True:
        time.sleep(0.05)
except KeyboardInterrupt:
    with open(here / "interrupted", "a") as f:
        f.write("KeyboardInterrupt\\n")
    time.sleep(0.3)  # a second SIGINT would interrupt this and be recorded too
    sys.exit(130)
'''


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
        return f.read().split(") ")[-1][0] != "Z"


def _start(tmp_path: Path) -> subprocess.Popen:
    (tmp_path / "child.py").write_text(CHILD)
    command = (f'. {SCRIPT}; FORWARD_PYTHON={sys.executable} run_forwarding {sys.executable} '
               f'{tmp_path / "child.py"} {tmp_path}; echo "rc=$? signal=$FORWARDED_SIGNAL"')
    # SIGINT at its default, as in a terminal (the outer run may be a background job)
    script = subprocess.Popen(["bash", "-c", command], stdout=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not (tmp_path / "pids").exists():
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.05)
    time.sleep(0.2)
    return script


def _pids(tmp_path: Path) -> list:
    return [int(p) for p in (tmp_path / "pids").read_text().split()]


def _gone_within(pids, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux process groups")
@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_to_the_script_reaches_the_child_group_once(tmp_path, sig, status):
    script = _start(tmp_path)
    pids = _pids(tmp_path)
    try:
        script.send_signal(sig)
        out, _ = script.communicate(timeout=20)
        assert _gone_within(pids, 10), "the child or its grandchild outlived the script"
        name = sig.name[3:]
        assert out.strip() == f"rc={status} signal={name}"
        if sig == signal.SIGINT:
            # a KeyboardInterrupt in the child, once: not a second Ctrl-C
            assert (tmp_path / "interrupted").read_text() == "KeyboardInterrupt\n"
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")
def test_a_script_killed_outright_takes_its_child_with_it(tmp_path):
    script = _start(tmp_path)
    pids = _pids(tmp_path)
    try:
        script.kill()
        script.wait(10)
        assert _gone_within(pids[:1], 10), "the child outlived a killed script"
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
