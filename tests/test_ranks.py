"""End-to-end tests of the ``ranks`` marker and the ``rank_pool`` fixture.

Each test runs a real pytest session in a subprocess (``-p weightsync``) whose ranks are real
spawned processes in a real gloo group. Starting ranks costs seconds on a small machine, so
each inner session exercises several behaviours against as few pool starts as possible.

Leftovers are detected by tagging the inner session's environment: every process it starts
inherits the tag, so after the session no process anywhere may still carry it, and the
private TMPDIR given to the session must be empty.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest

psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

#: Inner tests that check, from inside the session, that a torn-down pool left nothing.
CLEAN_CHECK = '''
def _leftovers():
    me = psutil.Process()
    children = [
        p for p in me.children(recursive=True)
        if not any(server in " ".join(p.cmdline())
                   for server in ("resource_tracker", "multiprocessing.forkserver"))
    ]
    dirs = [d for d in os.listdir(tempfile.gettempdir()) if d.startswith("weightsync-ranks-")]
    return children, dirs
'''


def test_ranks_marker_passes_fails_skips_and_times_out_without_leftovers(pytester, isolated):
    pytester.makepyfile(
        test_inner=textwrap.dedent(
            """
            import os, tempfile, time
            import psutil
            import pytest
            from pytest_weightsync.ranks import current, RankContext

            # torch is imported in the bodies only: the ranks need it, the parent does not.

            PIDS = []

            @pytest.fixture
            def offset():
                return 100

            @pytest.mark.ranks(2)
            @pytest.mark.parametrize("scale", [1, 3])
            def test_allreduce(scale, offset):
                import torch
                import torch.distributed as dist
                t = torch.tensor([float(dist.get_rank() + 1) * scale])
                dist.all_reduce(t)
                assert t.item() == 3 * scale
                assert offset == 100
                ctx = current()
                assert ctx == RankContext(dist.get_rank(), 2, "gloo", "cpu", "pool")
                assert torch.get_num_threads() == 1
                assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"

            class TestInClass:
                @pytest.mark.ranks(2)
                def test_method(self):
                    import torch.distributed as dist
                    assert dist.get_world_size() == 2

            def rank_and_pid(base):
                import torch.distributed as dist
                return base + dist.get_rank(), os.getpid(), current().rank

            def test_fixture_runs_in_the_same_warm_ranks(rank_pool):
                first = rank_pool.run(rank_and_pid, 2, 10)
                second = rank_pool.run(rank_and_pid, 2, base=20)
                assert [r[0] for r in first] == [10, 11]
                assert [r[0] for r in second] == [20, 21]
                assert [r[2] for r in second] == [0, 1]
                assert [r[1] for r in first] == [r[1] for r in second]
                assert os.getpid() not in [r[1] for r in first]

            def test_lambda_is_refused_clearly(rank_pool):
                with pytest.raises(TypeError, match="nested function|lambda"):
                    rank_pool.run(lambda: 1, 2)

            class Unpicklable:
                def __reduce__(self):
                    raise RuntimeError("no pickling for you")

            @pytest.fixture
            def handle():
                return Unpicklable()

            @pytest.mark.ranks(2)
            def test_unpicklable_fixture_value(handle):
                pass

            @pytest.mark.ranks(2)
            def test_skip_in_rank():
                import torch.distributed as dist
                pytest.skip(f"not today on rank {dist.get_rank()}")

            @pytest.mark.ranks(2)
            def test_rank_raises():
                import torch.distributed as dist
                print(f"rank {dist.get_rank()} says hello")
                if dist.get_rank() == 1:
                    raise ValueError("boom from rank 1")
                dist.barrier()  # rank 0 is stuck here until the pool is torn down

            """
        )
        + CLEAN_CHECK
        + textwrap.dedent(
            """
            def test_nothing_left_after_failure():
                assert _leftovers() == ([], [])

            @pytest.mark.ranks(1, timeout=3)
            def test_hangs():
                time.sleep(600)

            def test_nothing_left_after_hang():
                assert _leftovers() == ([], [])

            @pytest.mark.ranks(1)
            def test_later_tests_go_on():
                import torch.distributed as dist
                assert dist.get_world_size() == 1
            """
        )
    )
    result = pytester.runpytest_subprocess("-p", "weightsync", "-p", "no:cacheprovider", "-rs", "-v", timeout=300)
    out = result.stdout.str()
    result.assert_outcomes(passed=8, failed=3, skipped=1)
    outcome = {n: s for n, s in (line.split(" ", 1)[0:2] for line in result.stdout.lines if "::" in line and " " in line)}
    for name in ("test_allreduce[1]", "test_allreduce[3]", "TestInClass::test_method",
                 "test_nothing_left_after_failure", "test_nothing_left_after_hang", "test_later_tests_go_on"):
        assert outcome[f"test_inner.py::{name}"].startswith("PASSED"), name
    # skip propagated with the rank's own reason
    assert "SKIPPED [1] test_inner.py" in out and "not today on rank 0" in out
    # rank exception: the failing rank, its exception and traceback; the stuck rank's stack
    assert "1 of 2 ranks failed in test_rank_raises" in out
    assert "rank 1: ValueError: boom from rank 1" in out
    assert 'test_inner.py", line' in out and 'raise ValueError("boom from rank 1")' in out
    assert "rank 0: still running" in out and "in barrier" in out
    # what a rank prints is captured with the test that printed it
    captured = out.split("Captured stdout call")[1].split("___")[0]
    assert "rank 1 says hello" in captured
    # hang: timed out with each hung rank's Python stack, pointing into the test body
    assert "test_hangs timed out after 3 s" in out
    assert "rank(s) 0 of 1 still running" in out and "rank 0: hung" in out
    assert re.search(r'test_inner\.py", line \d+ in test_hangs', out), "no stack of the hung rank"
    assert "timeout 3 s from the ranks marker" in out
    # an argument that cannot be pickled is named
    assert "argument 'handle' (Unpicklable) cannot be pickled" in out


def test_no_pool_spawns_fresh_ranks_per_test(pytester, isolated):
    pytester.makepyfile(
        test_fresh=textwrap.dedent(
            """
            import os

            def pid():
                return os.getpid()

            def test_a(rank_pool, tmp_path_factory):
                (tmp_path_factory.getbasetemp() / "a").write_text(str(rank_pool.run(pid, 1)))

            def test_b(rank_pool, tmp_path_factory):
                (tmp_path_factory.getbasetemp() / "b").write_text(str(rank_pool.run(pid, 1)))
            """
        )
    )
    basetemp = pytester.path / "bt"
    result = pytester.runpytest_subprocess(
        "-p", "weightsync", "-p", "no:cacheprovider", "--weightsync-no-pool",
        f"--basetemp={basetemp}", timeout=300,
    )
    result.assert_outcomes(passed=2)
    assert (basetemp / "a").read_text() != (basetemp / "b").read_text()


def test_xdist_workers_run_ranks_side_by_side(pytester, isolated):
    pytest.importorskip("xdist")
    pytester.makepyfile(
        test_par=textwrap.dedent(
            """
            import os
            import pytest

            @pytest.mark.ranks(2)
            @pytest.mark.parametrize("i", range(4))
            def test_gather(i):
                import torch.distributed as dist
                out = [None, None]
                dist.all_gather_object(out, (dist.get_rank(), os.environ["PYTEST_XDIST_WORKER"]))
                assert [r for r, _ in out] == [0, 1]
                assert out[0][1] == out[1][1]  # both ranks belong to one xdist worker
            """
        )
    )
    result = pytester.runpytest_subprocess("-p", "weightsync", "-p", "no:cacheprovider", "-n", "2", "-v", timeout=300)
    result.assert_outcomes(passed=4)
    workers = {line.split("[gw")[1][0] for line in result.stdout.lines if "PASSED" in line and "[gw" in line}
    assert workers == {"0", "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_mode_uses_the_existing_process_group(pytester, isolated):
    pytester.makepyfile(
        test_tr=textwrap.dedent(
            """
            import os
            import pytest
            import torch.distributed as dist
            from pytest_weightsync.ranks import current

            @pytest.mark.ranks(2)
            def test_in_job_group():
                assert dist.get_world_size() == 2
                assert dist.get_rank() == int(os.environ["RANK"])
                out = [None, None]
                dist.all_gather_object(out, os.getpid())
                assert out[dist.get_rank()] == os.getpid()  # ran in-process, nothing spawned
                assert current().launcher == "torchrun"

            @pytest.mark.ranks(4)
            def test_needs_four():
                pass

            def twice(x):
                return 2 * x + dist.get_rank()

            def test_pool_gathers_to_every_rank(rank_pool):
                assert rank_pool.run(twice, 2, 5) == [10, 11]
            """
        )
    )
    port = _free_port()
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "pytest", "-p", "weightsync", "-p", "no:cacheprovider", "-rs",
             f"--basetemp={pytester.path / f'bt{rank}'}", "test_tr.py"],
            cwd=pytester.path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out
        assert "2 passed, 1 skipped" in out, out
        assert "ranks(4) needs WORLD_SIZE=4 under torchrun; this job has WORLD_SIZE=2" in out
    with socket.socket() as s:  # nothing listens on the rendezvous port any more
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()


def test_rank_pool_library_outside_pytest(pytester, isolated):
    script = pytester.makepyfile(
        lib_demo=textwrap.dedent(
            """
            from pytest_weightsync.ranks import RankPool, RankFailed, current

            def gather(x):
                import torch.distributed as dist
                out = [None] * dist.get_world_size()
                dist.all_gather_object(out, x * (dist.get_rank() + 1))
                return out, current().rank

            def fail():
                raise KeyError("missing expert 7")

            if __name__ == "__main__":
                with RankPool(world_size=2, backend="gloo") as pool:
                    assert pool.run(gather, 5) == [([5, 10], 0), ([5, 10], 1)]
                    try:
                        pool.run(fail)
                    except RankFailed as exc:
                        assert exc.failed_ranks == [0, 1], exc.failed_ranks
                        assert isinstance(exc.outcomes[0].exception, KeyError)
                        assert "missing expert 7" in str(exc)
                    else:
                        raise AssertionError("no RankFailed")
                    assert not pool.running  # a failure tears the pool down
                assert current() is None
                print("LIBRARY-OK")
            """
        )
    )
    result = pytester.run(sys.executable, str(script), timeout=240)
    assert result.ret == 0, result.stdout.str() + result.stderr.str()
    assert "LIBRARY-OK" in result.stdout.str()


def test_bad_ranks_markers_are_reported_without_starting_ranks(pytester, isolated):
    pytester.makepyfile(
        test_bad=textwrap.dedent(
            """
            import pytest

            @pytest.mark.ranks(0)
            def test_zero():
                pass

            @pytest.mark.ranks(2, backend="mpi")
            def test_backend():
                pass
            """
        )
    )
    result = pytester.runpytest_subprocess("-p", "weightsync", "-p", "no:cacheprovider", timeout=120)
    out = result.stdout.str()
    assert "needs a positive int n (the world size), got 0" in out
    assert "backend must be 'gloo', 'nccl' or None, got 'mpi'" in out
    assert "passed" not in out.splitlines()[-1]
