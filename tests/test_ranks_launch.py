"""gloo ranks forked from the fork server (``pytest_weightsync.ranks.launch``) get what a
spawned rank got from the pytest process - its environment now, its directory, the stdout of
the test that started them - and still die with the pytest process."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from pytest_weightsync.ranks import RankPool, launch

psutil = pytest.importorskip("psutil")


def _what_the_rank_has(name):
    import sys as rank_sys

    print(f"rank {os.getpid()} says hello", flush=True)
    return os.getppid(), os.environ.get(name), os.getcwd(), "torch" in rank_sys.modules


def test_gloo_ranks_are_forked_from_the_server_with_the_callers_environment(tmp_path,
                                                                           monkeypatch, capfd):
    with RankPool(1) as pool:
        pool.start()  # the server now runs, started with the environment of before
    monkeypatch.setenv("WEIGHTSYNC_LAUNCH_PROBE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    with RankPool(2) as pool:
        ((ppid, value, cwd, torch_in), _) = pool.run(_what_the_rank_has, "WEIGHTSYNC_LAUNCH_PROBE")
        pids = pool.pids
    assert launch.server_pid() is not None and ppid == launch.server_pid() != os.getpid()
    assert value == "set after the server started"
    assert os.path.samefile(cwd, tmp_path)
    assert torch_in
    out = capfd.readouterr().out  # the ranks write to the fds of the test that started them
    assert all(f"rank {pid} says hello" in out for pid in pids), out


def test_nccl_ranks_and_ranks_given_gpus_are_still_spawned():
    assert launch.context("nccl").get_start_method() == "spawn"
    assert launch.context("gloo", devices=("0",)).get_start_method() == "spawn"
    assert launch.context("gloo").get_start_method() == "forkserver"


KILLED_PARENT = textwrap.dedent("""
    import os, sys, time
    from pytest_weightsync.ranks import RankPool, launch
    pool = RankPool(2)
    pool.start()
    print(launch.server_pid(), *pool.pids, flush=True)
    time.sleep(600)
""")


def test_a_killed_parent_takes_its_forked_ranks_and_the_server_along():
    """SIGKILL leaves the parent no chance to clean up: the server sees its "alive" pipe close
    (the ranks let go of their copies) and exits; the ranks die with it (``PDEATHSIG``). What
    the killed parent cannot remove itself - ``multiprocessing``'s temporary directory with the
    server's socket - is made under a directory this test removes."""
    tmpdir = tempfile.mkdtemp(prefix="ws-killed-")
    proc = subprocess.Popen([sys.executable, "-c", KILLED_PARENT], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "TMPDIR": tmpdir})
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 3, pids
        assert all(psutil.pid_exists(p) for p in pids)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
    deadline = time.monotonic() + 20
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.05)
    assert not alive, f"left running after the parent was killed: {alive}"
