"""Warm ranks stay clean: a call that leaves process groups, threads, descriptors, child
processes or changed torch settings behind is named (``RankLeakWarning``: "+17 process
groups, +54 threads, +81 fds") and the ranks are restarted; a clean call is never flagged.
A hung rank that ignores the stack-dump signal is reported as such, not with an empty stack.

One warm pool of two gloo ranks serves the module (starting ranks costs seconds); each test
that leaks restarts it, which the next test's first call pays.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import warnings

import pytest

from pytest_weightsync.ranks import RankLeakWarning, RankPool, RankTimeout

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(scope="module")
def pool():
    with RankPool(2, timeout=120) as warm:
        yield warm


def run_recording(pool, fn, *args):
    """``pool.run(fn, *args)`` -> (results, messages of the RankLeakWarnings it raised)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = pool.run(fn, *args)
    return results, [str(w.message) for w in caught if issubclass(w.category, RankLeakWarning)]


# -- functions the ranks run --------------------------------------------------------------------


def groups_alive() -> int:
    import torch.distributed as dist

    return len(dist.distributed_c10d._world.pg_map)


def tidy_work():
    """Everything here is undone before returning: nothing may be flagged."""
    import torch
    import torch.distributed as dist

    group = dist.new_group([0, 1])
    t = torch.ones(4)
    dist.all_reduce(t, group=group)
    dist.broadcast(t, 0)
    dist.destroy_process_group(group)
    worker = threading.Thread(target=time.sleep, args=(0.01,))
    worker.start()
    worker.join()
    with open(__file__) as f:
        f.read(10)
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch.set_default_dtype(previous)
    with torch.no_grad():
        (torch.ones(300, 300) @ torch.ones(300, 300)).sum()
    return groups_alive()


def leaves_a_group():
    import torch
    import torch.distributed as dist

    group = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(1), group=group)


def leaves_a_child():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        return child.pid
    return None


def changes_global_settings():
    import torch

    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(2)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a later hang could not show its stack


def hangs_ignoring_sigusr1():
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    time.sleep(120)


def megatron_clean():
    """The project's model_parallel(): every group Megatron creates is destroyed and forgotten."""
    from pytest_weightsync.reference_impl.backends.megatron import model_parallel

    with model_parallel(tensor_model_parallel_size=2) as ps:
        assert ps.get_tensor_model_parallel_world_size() == 2


def megatron_reinitialized():
    """What exporters do in the wild: initialize, then only Megatron's own destroy."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    ps.destroy_model_parallel()


_HELD = []


def opens_a_log_file_and_a_plain_file(directory):
    """A library's log handler (kept for the process's life, like flashinfer's JIT log) and a
    file a call forgets to close, both in ``directory`` (the test's own: removed with it)."""
    import logging
    import tempfile

    paths = []
    for suffix in (".log", ".leaked"):
        fd, path = tempfile.mkstemp(suffix=suffix, dir=directory)
        os.close(fd)
        paths.append(path)
    logging.getLogger("weightsync-test-library").addHandler(logging.FileHandler(paths[0]))
    _HELD.append(open(paths[1]))


# -- the tests ----------------------------------------------------------------------------------


def test_a_clean_call_is_never_flagged(pool):
    first, found = run_recording(pool, tidy_work)
    starts = pool.starts
    for _ in range(3):
        again, found_again = run_recording(pool, tidy_work)
        assert again == first and not found_again, found_again
    assert not found, found
    assert pool.starts == starts  # the same warm processes throughout


def test_a_group_left_behind_is_named_and_the_ranks_restarted(pool):
    pool.run(groups_alive)
    starts = pool.starts
    _, found = run_recording(pool, leaves_a_group)
    assert len(found) == 1, found
    message = found[0]
    assert message.startswith("leaves_a_group left state behind in the warm rank processes "
                              "(world_size=2, backend=gloo): rank 0: +1 process group, +"), message
    assert re.search(r"rank 1: \+1 process group, \+\d+ threads?, \+\d+ fds? \(.*sockets?", message)
    assert "The ranks were restarted" in message
    fresh, found = run_recording(pool, groups_alive)
    assert pool.starts == starts + 1 and not found
    assert fresh == [1, 1]  # the new ranks hold the default group only


def test_a_child_process_left_behind_is_named_and_ended(pool):
    results, found = run_recording(pool, leaves_a_child)
    child = results[1]
    assert len(found) == 1 and f"rank 1: +1 child process still running (pid {child}: " in found[0]
    assert "rank 0" not in found[0]
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the restart did not end the child"


def test_changed_global_settings_are_named(pool):
    _, found = run_recording(pool, changes_global_settings)
    assert len(found) == 1
    assert ("rank 0: default dtype torch.float32 -> torch.float64, torch threads 1 -> 2, the "
            "stack-dump signal handler (SIGUSR1, faulthandler's) was replaced") in found[0], found


def test_megatron_reinitialized_without_destroying_its_groups_is_named(pool):
    pytest.importorskip("megatron.core")
    _, found = run_recording(pool, megatron_clean)
    assert not found, found
    _, found = run_recording(pool, megatron_reinitialized)
    assert len(found) == 1
    counts = re.search(r"rank 0: \+(\d+) process groups, \+(\d+) threads, \+(\d+) fds", found[0])
    assert counts and int(counts.group(1)) >= 10, found[0]


def test_a_hung_rank_that_ignores_the_stack_dump_signal_is_reported_as_such(pool):
    with pytest.raises(RankTimeout) as info:
        pool.run(hangs_ignoring_sigusr1, timeout=2)
    message = str(info.value)
    for rank in (0, 1):
        assert (f"rank {rank}: hung; still running after 2 s; rank {rank} did not answer the "
                f"stack-dump signal (SIGUSR1): it ignores SIGUSR1") in message, message


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_log_handlers_file_is_not_a_leak_a_forgotten_file_is(pool, tmp_path):
    _, found = run_recording(pool, opens_a_log_file_and_a_plain_file, str(tmp_path))
    assert found and all(re.search(r"\+1 fd \(1 file: \S+\.leaked\)", line) for line in found), found
    assert not any(re.search(r"\.log\b", line) for line in found), found
