"""What a refit under load costs beyond the update: pause -> update -> flush -> resume.

On the reference serving engine (``reference_impl/serving``), with N requests in flight, one
round of the whole sequence - ``pause_generation(mode)``, ``update_weights`` of a complete
model (flushing where the mode allows), ``continue_generation`` and the first scheduler step
after it (where a retracted request's KV is recomputed) - is timed against the update alone on
an idle engine, the same buckets, in the same run, interleaved (``pytest_weightsync.timing``).
The ratio is sequence / update: 1.0 means the control plane and the resume cost nothing.

    python benchmarks/bench_refit_under_load.py [--requests 1 4 16] [--repeats 7]

CPU only: the serving engine model computes on CPU (its forward is the oracle's, per token).
"""

from __future__ import annotations

import argparse
import json
import statistics

from pytest_weightsync.timing import interleaved_samples, machine_info

#: (dialect, pause mode, flush with the update): the sequences measured.
SEQUENCES = (("sglang", "retract", True), ("sglang", "in_place", False),
             ("vllm", "keep", False))


def _engine_with_requests(dialect: str, count: int):
    from pytest_weightsync.reference_impl.serving.engine import ServingEngine
    from pytest_weightsync.suites.harness import serving

    engine = ServingEngine(serving.spec(), version=1, dialect=dialect, max_running=count)
    for index in range(count):
        engine.submit(list(serving.PROMPTS[index % len(serving.PROMPTS)]), 100_000)
    for _ in range(3):
        engine.step()
    return engine


def measure(count: int, repeats: int) -> list:
    from pytest_weightsync.reference_impl.serving.engine import ServingEngine
    from pytest_weightsync.suites.harness import serving

    buckets = serving.update_buckets(2)
    idle = ServingEngine(serving.spec(), version=1)
    rows = []
    for dialect, mode, flush in SEQUENCES:
        engine = _engine_with_requests(dialect, count)

        def sequence(engine=engine, mode=mode, flush=flush, dialect=dialect):
            if dialect == "vllm":
                engine.pause_generation(mode, clear_cache=False)
            else:
                engine.pause_generation(mode)
            engine.update_weights(buckets, flush_cache=flush, weight_version=2)
            engine.continue_generation()
            engine.step()

        samples = interleaved_samples(
            {"update": lambda: idle.update_weights(buckets, weight_version=2),
             "sequence": sequence}, "cpu", repeats=repeats, warmup=1, best_of=1)
        update, whole = statistics.median(samples["update"]), statistics.median(samples["sequence"])
        ratios = [s / u for s, u in zip(samples["sequence"], samples["update"])]
        rows.append(dict(dialect=dialect, mode=mode, requests=count, update_ms=update * 1e3,
                         sequence_ms=whole * 1e3, ratio=statistics.median(ratios),
                         ratio_min=min(ratios), ratio_max=max(ratios)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = [row for count in args.requests for row in measure(count, args.repeats)]
    print(f"{'dialect':8} {'mode':9} {'N':>3} {'update ms':>10} {'sequence ms':>12} "
          f"{'ratio':>6} (min-max)")
    for r in rows:
        print(f"{r['dialect']:8} {r['mode']:9} {r['requests']:>3} {r['update_ms']:>10.2f} "
              f"{r['sequence_ms']:>12.2f} {r['ratio']:>6.2f} ({r['ratio_min']:.2f}-"
              f"{r['ratio_max']:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
