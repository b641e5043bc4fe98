"""Reliability of the warm rank pool: isolation between tests, cleanup on SIGTERM, diagnostics.

- A test that passes but leaves a collective pending on one rank must fail itself, naming
  what it left, and the next (innocent) test must get clean ranks.
- A rank's ``pytest.skip`` keeps the warm pool.
- An exception whose ``__str__`` raises, and a segfault, still reach the report with a
  Python stack of the test body.
- A test that passes but leaves a process group in the warm ranks is named in its own
  report (a ``RankLeakWarning``); more of that in ``test_ranks_hygiene.py``.
- SIGTERM to pytest ends the ranks, what a test body started in a new session, and the
  pool's temporary directory.

The end-to-end cases run a real pytest session in a subprocess whose ranks form a real gloo
group; starting ranks costs seconds, so one inner session covers several behaviours.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from pytest_weightsync.ranks import RankPool, RankStartupError, dispatch, leftovers, reaper, worker

psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
#: The inner sessions here leave files of their own in TMPDIR: only the pool's are judged.
ISOLATED_TMP_JUDGES = "weightsync-ranks-"


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


INNER = '''
import ctypes, os
import pytest

PIDS = []

def pid():
    return os.getpid()

def test_a_warm_pool(rank_pool):
    PIDS.extend(rank_pool.run(pid, 2))

@pytest.mark.ranks(2)
def test_b_every_rank_skips():
    pytest.skip("no fast path on this rank")

def test_c_skip_kept_the_warm_pool(rank_pool):
    assert rank_pool.run(pid, 2) == PIDS

@pytest.mark.ranks(2)
def test_d_leaves_a_collective_pending():
    import torch, torch.distributed as dist
    global WORK
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2
    if dist.get_rank() == 0:
        WORK = dist.all_reduce(torch.tensor([100.0]), async_op=True)  # never waited

@pytest.mark.ranks(2)
def test_e_innocent_next_test():
    import torch, torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2

class UnprintableError(Exception):
    def __str__(self):
        raise RuntimeError("__str__ is broken too")

@pytest.mark.ranks(2)
def test_f_broken_str_in_rank_0_segfault_in_rank_1():
    import torch.distributed as dist
    if dist.get_rank() == 0:
        raise UnprintableError("expert 7 missing")
    ctypes.string_at(0)

@pytest.mark.ranks(2)
def test_g_passes_but_leaves_a_group():
    import torch, torch.distributed as dist
    group = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(1), group=group)  # never destroyed
'''


def test_pool_blames_the_test_that_left_ranks_out_of_step_and_keeps_diagnostics(pytester, isolated):
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_subprocess("-p", "weightsync", "-p", "no:cacheprovider", "-rs", "-v", timeout=300)
    out = result.stdout.str()
    result.assert_outcomes(passed=4, failed=2, skipped=1, warnings=1)
    outcome = {}
    for line in result.stdout.lines:  # the verbose progress lines; the warnings summary repeats ids
        if line.startswith("test_inner.py::"):
            outcome.setdefault(line.split(" ", 1)[0], line)
    for name in ("test_a_warm_pool", "test_c_skip_kept_the_warm_pool", "test_e_innocent_next_test",
                 "test_g_passes_but_leaves_a_group"):
        assert "PASSED" in outcome[f"test_inner.py::{name}"], out
    for name in ("test_d_leaves_a_collective_pending", "test_f_broken_str_in_rank_0_segfault_in_rank_1"):
        assert "FAILED" in outcome[f"test_inner.py::{name}"], out
    assert "no fast path on this rank" in out
    # the culprit fails, saying what it left; the innocent next test passed above
    assert "test_d_leaves_a_collective_pending returned in every rank but left the ranks out of step" in out
    assert "async_op=True work never waited" in out
    assert "rank 0: 2, rank 1: 1" in out  # operations each rank issued during the call
    assert "The ranks were restarted" in out
    # one test, two lost-diagnostics cases (one pool start less):
    # rank 0's broken __str__: type name, repr fallback and the traceback into the test body
    assert "rank 0: UnprintableError: UnprintableError('expert 7 missing')" in out
    assert "__str__ raised RuntimeError" in out
    assert 'raise UnprintableError("expert 7 missing")' in out
    # rank 1's segfault: the signal and the Python stack of the test body at the crash
    assert "rank 1: process died without answering (killed by signal 11 (SIGSEGV))" in out
    assert re.search(r'test_inner\.py", line \d+ in test_f_broken_str_in_rank_0_segfault_in_rank_1', out), out
    # a passing test that leaves a group behind is named in its own report, and the pool rebuilt
    summary = out[out.index("warnings summary"):]
    assert re.search(r"test_inner\.py::test_g_passes_but_leaves_a_group\n.*RankLeakWarning: "
                     r"test_g_passes_but_leaves_a_group left state behind in the warm rank "
                     r"processes \(world_size=2, backend=gloo\): rank 0: \+1 process group, "
                     r"\+\d+ threads, \+\d+ fds", summary), summary


SIGTERM_INNER = '''
import subprocess, sys, time
import pytest

@pytest.mark.ranks(1)
def test_starts_a_detached_child_then_waits():
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
    )
    with open("child.pid.tmp", "w") as f:
        f.write(str(child.pid))
    import os
    os.replace("child.pid.tmp", "child.pid")
    time.sleep(600)
'''


def test_sigterm_ends_ranks_detached_children_and_the_temp_dir(pytester, isolated):
    tag, tmpdir = isolated
    pytester.makepyfile(test_term=SIGTERM_INNER)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "weightsync", "-p", "no:cacheprovider", "test_term.py"],
        cwd=pytester.path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    pid_file = pytester.path / "child.pid"
    try:
        deadline = time.monotonic() + 200
        while not pid_file.exists():
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the rank never started its child"
            time.sleep(0.1)
        child = int(pid_file.read_text())
        assert running(child)
        assert [d for d in os.listdir(tmpdir) if d.startswith("weightsync-ranks-")]
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, out
    assert "SIGTERM received" in out, out
    assert not running(child), "the new-session child of the rank survived SIGTERM"
    # the isolated fixture checks no tagged process and no weightsync-ranks-* dir is left


# -- no ranks needed ---------------------------------------------------------------------------


class UnprintableError(Exception):
    def __str__(self):
        raise RuntimeError("no")


def test_broken_str_is_reported_by_type_and_repr():
    try:
        raise UnprintableError("payload", 7)
    except UnprintableError as exc:
        summary = worker._summary(exc)
        detail = worker._format(exc)
        kind, reply_summary, reply_detail, _ = worker._error_reply(exc)
    assert summary.startswith("UnprintableError: UnprintableError('payload', 7) (")
    assert summary.endswith("UnprintableError.__str__ raised RuntimeError)")
    assert "raise UnprintableError(\"payload\", 7)" in detail
    assert "str() failed" not in detail and "UnprintableError('payload', 7)" in detail
    assert (kind, reply_summary, reply_detail) == ("error", summary, detail)


def test_descendants_follow_parentage_across_sessions():
    script = (
        "import subprocess, sys, time\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
        "print(c.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        found = reaper.descendants([parent.pid])
        assert {pid for pid, _ in found} == {child}
        assert os.getsid(child) != os.getsid(parent.pid)  # not reachable through killpg
        killed = reaper.end_all([parent.pid])
        assert {pid for pid, _ in killed} == {child}
        deadline = time.monotonic() + 10
        while running(child) and time.monotonic() < deadline:  # a zombie of `parent` counts as dead
            time.sleep(0.02)
        assert not running(child)
        assert reaper.alive(found) == set()  # a dead (or reused) pid is never signalled again
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()


def test_start_timeout_is_enforced_and_named():
    started = time.monotonic()
    with pytest.raises(RankStartupError, match=r"did not join the gloo process group within 0\.001 s"):
        RankPool(1, start_timeout=0.001).start()  # a forked rank joins in ~0.1 s
    assert time.monotonic() - started < 30


def test_pool_cache_passes_the_start_timeout(monkeypatch):
    seen = {}

    class FakePool:
        def __init__(self, *args, **kwargs):
            seen.update(kwargs)
            self.start_timeout = kwargs["start_timeout"]

        def call(self, *args, **kwargs):
            return [seen["start_timeout"]]

        def close(self):
            pass

    monkeypatch.setattr("pytest_weightsync.ranks.pool.RankPool", FakePool)
    cache = dispatch.PoolCache(reuse=True)
    assert cache.run((1, "gloo", 1, None), None, b"", 5.0, "f", 42.0) == [42.0]


def test_sweep_removes_only_abandoned_pool_dirs_and_ends_their_processes(tmp_path):
    def pool_dir(name, age):
        d = tmp_path / f"{leftovers.PREFIX}{name}"
        d.mkdir()
        (d / leftovers.LOCK_NAME).touch()
        os.utime(d, (time.time() - age, time.time() - age))
        return d

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        identity = reaper.alive({(sleeper.pid, reaper.process_table()[sleeper.pid][1])})
        abandoned = pool_dir("abandoned", 3600)
        leftovers.record(str(abandoned), identity)
        os.utime(abandoned, (time.time() - 3600, time.time() - 3600))
        young = pool_dir("young", 0)
        alive = pool_dir("alive", 3600)
        fd = leftovers.claim(str(alive))  # a live owner holds its lock
        try:
            assert leftovers.sweep(str(tmp_path)) == [str(abandoned)]
        finally:
            os.close(fd)
        assert sleeper.wait(timeout=10) == -signal.SIGKILL
        assert not abandoned.exists() and young.exists() and alive.exists()
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()
