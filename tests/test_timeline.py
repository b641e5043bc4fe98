"""An update's bucket timeline (``reference_impl/senders/timeline.py``): the arithmetic of the
device's estimate on marks of known times, and the marks of a real per-update sync through
engine processes - both sides on one clock, in the order the protocol makes them."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pytest_weightsync.reference_impl.engine import process as engine_process  # noqa: E402
from pytest_weightsync.reference_impl.engine.process import UpdateReport  # noqa: E402
from pytest_weightsync.reference_impl.model.layout import MoESpec, ReceiverTopology  # noqa: E402
from pytest_weightsync.reference_impl.oracle import synth  # noqa: E402
from pytest_weightsync.reference_impl.senders.colocated import (  # noqa: E402
    ColocatedSender,
    ColocatedSync,
    SyncTiming,
)
from pytest_weightsync.reference_impl.senders.timeline import (  # noqa: E402
    bucket_timeline,
    format_timeline,
)


def report(rank, nbytes, clock):
    return UpdateReport(rank, 1, nbytes, (), None, {}, (), clock)


def test_the_device_waits_for_the_slowest_rank_and_for_the_previous_copy():
    t = 100.0  # the update starts at 100 s; marks in ms after it
    at = lambda ms: t + ms / 1e3  # noqa: E731
    timing = SyncTiming()
    timing.clock = [("start", None, t), ("staged", 0, at(0.1)), ("posted", 0, at(0.3)),
                    ("answered", 0, at(1.0)), ("staged", 1, at(1.1)), ("posted", 1, at(1.2)),
                    ("answered", 1, at(2.0)), ("done", 1, at(5.5))]
    # bucket 0: rank 1 queues last (0.9 ms); bucket 1 is queued (1.8 ms) while 0 still copies
    timing.reports = [[report(0, 100, (at(0.4), at(0.5), at(0.6), at(0.7))),
                       report(1, 100, (at(0.5), at(0.7), at(0.9), at(0.95)))],
                      [report(0, 200, (at(1.3), at(1.5), at(1.8), at(1.9))),
                       report(1, 200, (at(1.3), at(1.4), at(1.6), at(1.9)))]]
    line = bucket_timeline(timing, copy_s=6e-3)  # 600 bytes in 6 ms: 1 ms per 100 bytes
    first, second = line["buckets"]
    assert first["bytes"] == 200 and second["bytes"] == 400
    assert first["queued"] == pytest.approx(0.9) and first["taken"] == pytest.approx(0.5)
    assert first["copy_from"] == pytest.approx(0.9) and first["copy_to"] == pytest.approx(2.9)
    assert first["idle"] == pytest.approx(0.9)
    # queued at 1.8 ms, before bucket 0's copy ends: no idle, it follows at once
    assert second["copy_from"] == pytest.approx(2.9) and second["idle"] == pytest.approx(0.0)
    assert second["copy_to"] == pytest.approx(6.9)
    assert line["idle_ms"] == pytest.approx(0.9)
    assert line["done_ms"] == pytest.approx(5.5) and line["tail_ms"] == pytest.approx(-1.4)
    assert (first["staged"], first["posted"], first["answered"]) == pytest.approx((0.1, 0.3, 1.0))
    text = format_timeline(line)
    assert len(text.splitlines()) == 4 and "idle 0.90 ms" in text


def test_an_update_without_its_clock_or_a_copy_time_is_refused():
    with pytest.raises(ValueError, match="clock and reports"):
        bucket_timeline(SyncTiming(), 1e-3)
    timing = SyncTiming()
    timing.clock = [("start", None, 1.0), ("done", 0, 2.0)]
    timing.reports = [[report(0, 10, (1.1, 1.2, 1.3, 1.4))]]
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="copy_s"):
            bucket_timeline(timing, bad)


SPEC = MoESpec(num_layers=3, num_experts=4, hidden=32, intermediate=16)


@pytest.mark.parametrize("per_update", [True, False], ids=["per_update", "registered"])
def test_a_real_updates_marks_are_on_one_clock_in_the_protocols_order(per_update):
    topo = ReceiverTopology(tp=2)
    full = synth.grouped_full_weights(SPEC, 3)
    layer = 3 * SPEC.num_experts * SPEC.intermediate * SPEC.hidden * 2
    engines = [engine_process.ReceiverProcess("cpu", timeout=120) for _ in range(2)]
    try:
        for rank, engine in enumerate(engines):
            engine.start()
            engine.configure(SPEC, topo, rank)
        sync = ColocatedSync(ColocatedSender("packed", SPEC, topo, full, bucket_bytes=layer),
                             engines, per_update=per_update)
        sync.update()
        timing = sync.update()
        sync.close()
    finally:
        for engine in engines:
            engine.close()
    # bucket b + 1 is staged before b's answer is taken, and posted after it
    assert [(what, bucket) for what, bucket, _ in timing.clock] == [
        ("start", None), ("staged", 0), ("posted", 0), ("staged", 1), ("answered", 0),
        ("posted", 1), ("staged", 2), ("answered", 1), ("posted", 2), ("answered", 2),
        ("done", 2)]
    times = [t for _, _, t in timing.clock]
    assert times == sorted(times)  # the trainer's marks, in the order they were made
    marks = {(what, bucket): t for what, bucket, t in timing.clock}
    assert len(timing.reports) == 3
    for index, reports in enumerate(timing.reports):
        staged, posted = marks[("staged", index)], marks[("posted", index)]
        answered = marks[("answered", index)]
        assert staged <= posted <= answered
        for r in reports:
            taken, rebuilt, queued, done = r.clock
            # the engine takes the bucket after the trainer staged it and is done before the
            # trainer has its answer: another process's marks on the same clock
            assert staged <= taken <= rebuilt <= queued <= done <= answered
    line = bucket_timeline(timing, copy_s=1e-3)
    assert [b["bucket"] for b in line["buckets"]] == [0, 1, 2]
    assert line["done_ms"] == pytest.approx((marks[("done", 2)] - marks[("start", None)]) * 1e3)
    assert all(b["idle"] >= 0 and b["copy_to"] > b["copy_from"] for b in line["buckets"])


def test_the_benchmark_prints_each_rows_timeline(capsys):
    # bench_e2e.py --timeline on CPU: the median update's timeline has a line per bucket
    import argparse
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_e2e.py"
    spec = importlib.util.spec_from_file_location("bench_e2e_timeline", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    moe = MoESpec(num_layers=2, num_experts=4, hidden=32, intermediate=16)
    part = bench.ExpertsPart(moe, torch.device("cpu"))
    topo = ReceiverTopology(tp=1)
    engines = [engine_process.ReceiverProcess("cpu", timeout=120)]
    try:
        engines[0].start()
        ptrs = [engines[0].configure(moe, topo, 0)]
        failures: list = []
        rows = []
        for ramp in (False, True):
            args = argparse.Namespace(formats=["packed"], staging_mib=1, repeats=3, warmup=2,
                                      progress=None, timeline=True, bucket_ramp=ramp)
            rows += bench.per_update_rows(part, engines, topo, 1, args, bench.Masks(),
                                          bench.PlainCopy(part.written_bytes(topo), "cpu", 1 << 20),
                                          ptrs, failures)
    finally:
        engines[0].close()
    assert failures == [] and [r["bits"] for r in rows] == ["exact", "exact"]
    assert [(r["bucket_ramp"], r["buckets"]) for r in rows] == [(False, 1), (True, 2)]
    for row in rows:
        assert len(row["timeline"]["buckets"]) == row["buckets"]
    out = capsys.readouterr().out
    assert out.count("done at") == 2 and out.count("  bucket recv GiB") == 2


def test_the_benchmark_runs_the_engine_ranks_in_turn_with_a_line_per_rank_and_bucket(tmp_path,
                                                                                     capsys):
    # bench_e2e.py --ranks-in-turn at MoE-TP 2 on CPU: every row bit-exact and in turn (but
    # direct, whose gathered trainer stages both ranks' rows at once), and the timeline has a
    # line per rank and bucket
    import importlib.util
    import json
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_e2e.py"
    spec = importlib.util.spec_from_file_location("bench_e2e_in_turn", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "turn.json"
    assert bench.main(["--device", "cpu", "--tp", "2", "--formats", "packed", "direct",
                       "--repeats", "3", "--per-update", "--ranks-in-turn", "--timeline",
                       "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["path"], r["format"], r["ranks_in_turn"]) for r in rows] == [
        ("registered", "packed", True), ("registered", "direct", False),
        ("per_update", "packed", True), ("per_update", "direct", False)]
    for row in rows:
        assert row["bits"] == "exact"
        assert len(row["timeline"]["buckets"]) == row["buckets"] * (2 if row["ranks_in_turn"] else 1)
    assert capsys.readouterr().out.count("done at") == 4
