"""``timing.ProcessesCopy``: one plain copy split over several processes at once - the copy
limit of engine ranks that share one GPU (each process its own CUDA context), which
``bench_e2e.py`` reports as a row's second ratio at MoE-TP > 1.

On CPU the processes copy host memory; what is checked here is what holds on any device:
the split adds up to the bytes asked for, every process answers every round, and no process
outlives a close or a failure."""

from __future__ import annotations

import importlib.util
import math
import multiprocessing
import pathlib

import pytest

from pytest_weightsync.timing import ProcessesCopy, _copy_share


def _children() -> list:
    return [p for p in multiprocessing.active_children() if p.is_alive()]


def test_the_split_copy_times_every_process_and_a_dead_one_fails_the_next_round_at_once():
    # one set of processes for both (each spawn imports torch: seconds)
    before = set(_children())
    split = ProcessesCopy((8 << 20) + 3, "cpu", 3, chunk=1 << 20, timeout=60)
    try:
        procs = list(split._procs)
        assert len(procs) == 3 and all(p.is_alive() for p in procs)
        rounds = [split.seconds() for _ in range(3)]
        assert all(math.isfinite(s) and 0 < s < 60 for s in rounds), rounds
        procs[1].kill()
        procs[1].join()
        with pytest.raises(RuntimeError, match=r"exited \(code -9\) before its 'done'"):
            split.seconds()
    finally:
        split.close()
    assert all(not p.is_alive() for p in procs) and not split._procs
    assert set(_children()) <= before
    with pytest.raises(RuntimeError, match="closed"):
        split.seconds()
    split.close()  # twice is harmless


@pytest.mark.parametrize("kwargs, match", [
    (dict(nbytes=0, device="cpu", processes=2), "nbytes must be an int >= 1"),
    (dict(nbytes=1 << 20, device="cpu", processes=0), "processes must be an int >= 1"),
    (dict(nbytes=1 << 20, device="cpu", processes=True), "processes must be an int >= 1"),
    (dict(nbytes=1 << 20, device="cpu", processes=2, chunk=0), "chunk must be an int >= 1"),
    (dict(nbytes=2, device="cpu", processes=3), "at least one byte per process"),
])
def test_what_cannot_be_split_is_refused_before_a_process_starts(kwargs, match):
    before = set(_children())
    with pytest.raises(ValueError, match=match):
        ProcessesCopy(**kwargs)
    assert set(_children()) == before


def test_a_process_that_cannot_copy_is_reported_and_none_is_left():
    before = set(_children())
    with pytest.raises(RuntimeError, match="a copying process failed: RuntimeError: .*nonsense"):
        ProcessesCopy(1 << 20, "nonsense", 2, timeout=60)
    assert set(_children()) <= before


def test_each_process_copies_its_share_in_chunks_and_answers_each_start():
    # The worker in this process: 5 bytes in chunks of 2 (two full chunks and a tail), one
    # timed round, then the stop.
    import queue
    import time

    go, out = queue.Queue(), queue.Queue()
    go.put(time.perf_counter())
    go.put(None)
    _copy_share("cpu", 5, 2, go, out)
    assert out.get_nowait() == ("ready", None)
    kind, end = out.get_nowait()
    assert kind == "done" and end <= time.perf_counter()
    assert out.empty()


def test_a_bench_row_reports_the_split_limit_beside_the_plain_copy(capsys):
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_e2e.py"
    spec = importlib.util.spec_from_file_location("bench_e2e_split", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    row = dict(path="per_update", format="packed", moe_tp=2, layers=8, entries=16,
               nbytes=12 << 30, wall_s=0.011, plain_copy_s=0.0088, ratio=0.80, ratio_min=0.79,
               ratio_max=0.81, bits="exact", split_processes=2, split_copy_s=0.0098,
               ratio_split=0.891, ratio_split_min=0.88, ratio_split_max=0.90)
    bench.print_row(row)
    out = capsys.readouterr().out
    assert "ratio 0.800 [0.790, 0.810]" in out
    assert "2 processes copying their shares at once     9.80 ms: ratio 0.891 [0.880, 0.900]" in out
    bench.print_row(dict(row, split_processes=None, split_copy_s=None, ratio_split=None))
    assert "processes copying" not in capsys.readouterr().out
