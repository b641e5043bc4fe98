"""Overhead of running a trivial function in 4 gloo ranks: cold start vs. warm pool.

What a ``ranks``-marked test pays on top of its own work:

- cold: the first call of a session (spawn 4 interpreters, import torch, rendezvous, call),
  also what every test pays with ``--weightsync-no-pool``;
- warm: every later call on the kept-alive pool (pickle the call, one round trip per rank).

Run: ``python benchmarks/bench_rank_pool.py [--world-size 4] [--cold 3] [--warm 30]``.
Prints the median (and min/max) of each in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time


def trivial(x):
    """A test body that does one collective, like the smallest real multi-rank test."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, x + dist.get_rank())
    return out


def measure(world_size: int, cold_runs: int, warm_runs: int) -> dict[str, list[float]]:
    from pytest_weightsync.ranks import RankPool

    cold, warm = [], []
    for _ in range(cold_runs):
        with RankPool(world_size, backend="gloo", threads=1) as pool:
            start = time.perf_counter()
            pool.run(trivial, 1)
            cold.append(time.perf_counter() - start)
            if not warm:
                for i in range(warm_runs):
                    start = time.perf_counter()
                    assert pool.run(trivial, i) == [[i + r for r in range(world_size)]] * world_size
                    warm.append(time.perf_counter() - start)
    return {"cold (spawn + rendezvous + call)": cold, "warm (pooled call)": warm}


def main() -> None:
    import torch

    torch.set_num_threads(1)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--cold", type=int, default=3, help="cold starts to time (default 3)")
    parser.add_argument("--warm", type=int, default=30, help="warm calls to time (default 30)")
    args = parser.parse_args()
    results = measure(args.world_size, args.cold, args.warm)
    print(f"trivial all_gather_object in {args.world_size} gloo ranks, torch {torch.__version__}")
    print(f"{'case':<34} {'n':>3} {'median ms':>10} {'min ms':>9} {'max ms':>9}")
    for name, times in results.items():
        ms = [t * 1e3 for t in times]
        print(f"{name:<34} {len(ms):>3} {statistics.median(ms):>10.1f} {min(ms):>9.1f} {max(ms):>9.1f}")
    ratio = statistics.median(results["cold (spawn + rendezvous + call)"]) / statistics.median(
        results["warm (pooled call)"]
    )
    print(f"a warm call costs 1/{ratio:.0f} of a cold start")


if __name__ == "__main__":
    main()
