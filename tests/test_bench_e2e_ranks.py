"""``benchmarks/bench_e2e_ranks.py``: one trainer rank and one engine rank per device.

It runs on CPU as it does on GPUs (each rank's device is then the host): the whole run once
with every bit checked, and its combination of the ranks' rows, which must locate a rank whose
engine missed an update (digests that do not add up) or failed its bit check."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_e2e_ranks.py"


def load():
    """The script as a module; sys.path as it was (the script puts its folder first)."""
    path = list(sys.path)
    try:
        spec = importlib.util.spec_from_file_location("bench_e2e_ranks", BENCH)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path
    return module


def rank_row(wall, plain, bits="exact"):
    return dict(path="per_update", format="packed", moe_tp=2, trainer_etp=1, walls_s=wall,
                plain_copies_s=plain, bits=bits, entries=2, storages=2, staged_bytes=0,
                nbytes=100, export_s=0.1, serialize_s=0.2, receive_s=0.3, load_s=0.4,
                synchronize_s=0.0, wall_s=max(wall), plain_copy_s=max(plain))


def test_the_ranks_combine_into_the_slowest_rank_per_round_and_their_digests_add_up():
    bench = load()
    rows = [[rank_row([2.0, 4.0, 3.0], [1.0, 1.0, 1.0])], [rank_row([3.0, 2.0, 3.0], [1.5, 1.0, 1.0])]]
    logs = [[[([(5, 7)], (9, 16))]], [[([(4, 9)], (9, 16))]]]  # one update: 5 + 4, 7 + 9
    (row,), failures = bench.combine(rows, logs)
    assert failures == [] and row["bits"] == "exact"
    assert row["walls_s"] == [3.0, 4.0, 3.0] and row["plain_copies_s"] == [1.5, 1.0, 1.0]
    assert row["ratio"] == pytest.approx(1 / 3) and row["ratio_min"] == 0.25
    assert row["ratio_max"] == 0.5 and row["entries"] == 4 and row["gpus"] == 2
    missed = [[[([(5, 7)], (9, 16))]], [[([(3, 9)], (9, 16))]]]  # rank 1 missed an element
    (row,), failures = bench.combine(rows, missed)
    assert "update 1: engines' digests add up to (8, 16)" in row["bits"] and len(failures) == 1
    wrong = [rows[0], [rank_row([3.0, 2.0, 3.0], [1.0] * 3, bits="w13 [0, 1, 2] differs")]]
    (row,), failures = bench.combine(wrong, logs)
    assert row["bits"].startswith("rank 1: w13 [0, 1, 2] differs") and "one rank per GPU" in failures[0]


def test_one_rank_per_device_runs_and_checks_its_bits_on_cpu(tmp_path):
    out = tmp_path / "ranks.json"
    done = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--tp", "2",
                           "--per-update", "--no-registered", "--formats", "direct",
                           "--trainer-etp", "--repeats", "3", "--json", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    # direct: staged from the gathered trainer, then views of the trainer's ETP shards
    assert [(r["format"], r["trainer_etp"]) for r in rows] == [("direct", 1), ("direct", 2)]
    assert rows[0]["staged_bytes"] > 0 and rows[1]["staged_bytes"] == 0
    assert all(r["bits"] == "exact" and r["gpus"] == 2 and len(r["walls_s"]) == 3 for r in rows)
    assert all(r["cache_hits"] > 0 and r["cache_other"] == 0 for r in rows), rows
    assert all(r["digests"] == 2 + 3 for r in rows)


def test_one_rank_per_gpu_refuses_what_it_cannot_run(capsys):
    bench = load()
    for extra in (["--per-tensor"], ["--ranks-in-turn"], ["--repeats", "2"]):
        with pytest.raises(SystemExit) as exit_:
            bench.main(["--device", "cpu", *extra])
        assert exit_.value.code == 2
        assert ("do not apply" if extra[0] != "--repeats" else "at least 3") in capsys.readouterr().err
